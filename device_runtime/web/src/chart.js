// @ts-check
// The results' chart: the held-out accuracy after each round, with chance for reference.

/** @typedef {import('./store.js').RoundRecord} RoundRecord */

const SVG = 'http://www.w3.org/2000/svg';

/**
 * A small chart of the held-out accuracy after each round, with chance as a dashed line (SVG drawn by script:
 * the page's CSP allows no inline styles, so the look is in style.css).
 * @param {Element} chart the page's <svg>
 * @param {RoundRecord[]} rounds
 * @param {number | null} chance
 */
export function drawChart(chart, rounds, chance) {
  const [left, right, top, bottom] = [34, 312, 8, 108];
  const x = (/** @type {number} */ i) =>
    rounds.length < 2 ? (left + right) / 2 : left + ((right - left) * i) / (rounds.length - 1);
  const y = (/** @type {number} */ v) => bottom - (bottom - top) * v;
  const shape = (/** @type {string} */ tag, /** @type {Record<string, string | number>} */ attributes, text = '') => {
    const element = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attributes)) element.setAttribute(name, String(value));
    if (text) element.textContent = text;
    return element;
  };
  const parts = [
    shape('line', { class: 'axis', x1: left, x2: right, y1: bottom, y2: bottom }),
    shape('line', { class: 'axis', x1: left, x2: right, y1: top, y2: top }),
    shape('text', { x: 0, y: top + 4 }, '100%'),
    shape('text', { x: 12, y: bottom + 4 }, '0%'),
  ];
  if (chance != null) parts.push(shape('line', { class: 'chance', x1: left, x2: right, y1: y(chance), y2: y(chance) }));
  if (rounds.length) {
    const points = rounds.map((r, i) => `${x(i).toFixed(1)},${y(/** @type {number} */ (r.accuracy)).toFixed(1)}`);
    parts.push(shape('polyline', { class: 'line', points: points.join(' ') }));
    rounds.forEach((r, i) => {
      parts.push(shape('circle', { class: 'dot', cx: x(i), cy: y(/** @type {number} */ (r.accuracy)), r: 3.5 }));
    });
    const labels =
      rounds.length < 2
        ? [[0, 'middle']]
        : [
            [0, 'start'],
            [rounds.length - 1, 'end'],
          ];
    for (const [i, anchor] of labels)
      parts.push(
        shape('text', { x: x(Number(i)), y: bottom + 18, 'text-anchor': anchor }, `round ${rounds[Number(i)].round}`),
      );
  }
  chart.replaceChildren(...parts);
}
