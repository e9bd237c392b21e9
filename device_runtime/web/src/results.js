// @ts-check
// The words around a measured accuracy, for the person holding the phone: which model was measured on what (the
// shared model untrained on their examples, or their own after round N), guessing for reference, and a result
// below guessing flagged with what to do. Pure functions: ui.js, runner.js and tryit.js show them, Node tests
// check them.

/**
 * What was measured. `final`: the run is over and the model is the final shared one (with this phone's own part);
 * `roundsHere`: how many rounds this phone trained; `round`: the round after which it was measured; `words`: how
 * the bundle's kind names its samples (kinds.js).
 * @typedef {object} Measured
 * @property {number} accuracy
 * @property {number} count
 * @property {boolean} final
 * @property {number} roundsHere
 * @property {number | null} round
 * @property {Pick<import('./kinds.js').KindWords, 'one' | 'right'>} words
 */

export const SHARED_UNTRAINED =
  'the shared model, which never trained on your examples (this phone took part in no round)';
const ROUGH_BELOW = 30; // examples kept aside: with fewer, one example more or less moves the number by 3 points or more

/** A fraction as a percentage with one decimal, or a dash. */
export function pct(/** @type {number | null | undefined} */ value) {
  return value == null || Number.isNaN(value) ? '–' : `${(100 * value).toFixed(1)}%`;
}

/** Which model a number is of, in words: "the shared model, not trained on your examples", or "your model after round 3". */
export function measuredModel(
  /** @type {Pick<Measured, 'final' | 'roundsHere' | 'round'>} */ { final, roundsHere, round },
) {
  if (!roundsHere) return final ? SHARED_UNTRAINED : 'the model as it came, untrained';
  if (final) return 'your model (the final shared model with the part this phone trained)';
  return `your model after round ${round}`;
}

/** The sentence a result is: "6.7% of the 15 examples kept aside are recognised by …". @param {Measured} measured */
export function scoreSentence(measured) {
  return `${pct(measured.accuracy)} ${scoreWhat(measured)}`;
}

/** What follows the number: "of the 15 examples kept aside are recognised by …". @param {Measured} measured */
export function scoreWhat(measured) {
  const { words } = measured;
  return `of the ${plural(measured.count, words.one)} kept aside are ${words.right} by ${measuredModel(measured)}`;
}

/**
 * Guessing for reference, and a result below it flagged with what to do (null `accuracy`: nothing measured yet).
 * @param {number | null} accuracy
 * @param {number} count examples kept aside
 * @param {number} classes classes the examples hold
 * @returns {{text: string, below: boolean}}
 */
export function chanceWords(accuracy, count, classes) {
  if (classes < 2)
    return {
      text: 'All your examples show one class: add another class to make the number mean something.',
      below: false,
    };
  const chance = 1 / classes;
  const guess = `Guessing among your ${classes} classes would get ${pct(chance)}.`;
  if (accuracy == null || accuracy >= chance) return { text: guess, below: false };
  const rough = count < ROUGH_BELOW ? ` With only ${plural(count, 'example')} kept aside the number is rough, but` : '';
  return {
    text: `${guess}${rough} ${rough ? 'this' : 'This'} is below guessing: the model has not learned your classes yet. Add more examples of each class, and check that each example is under the right class.`,
    below: true,
  };
}

/** "1 example", "3 examples". */
export function plural(/** @type {number} */ n, /** @type {string} */ word, many = `${word}s`) {
  return `${n} ${n === 1 ? word : many}`;
}
