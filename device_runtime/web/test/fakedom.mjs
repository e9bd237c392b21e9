// Just enough of a page's DOM for the page's sections to run under Node: elements by id (each made on first use),
// their text, dataset, value and events, and the element classes the page checks with instanceof.

class FakeElement {
  constructor(id = '') {
    this.id = id;
    this.textContent = '';
    this.value = '';
    this.hidden = true;
    this.disabled = false;
    this.dataset = /** @type {Record<string, string>} */ ({});
    this.children = /** @type {FakeElement[]} */ ([]);
    this.listeners = /** @type {Record<string, ((event: any) => void)[]>} */ ({});
    this.classList = { add() {}, toggle() {} };
    this.href = '';
  }

  addEventListener(/** @type {string} */ type, /** @type {(event: any) => void} */ listener) {
    if (!this.listeners[type]) this.listeners[type] = [];
    this.listeners[type].push(listener);
  }

  dispatchEvent(/** @type {{type: string}} */ event) {
    for (const listener of this.listeners[event.type] || []) listener(event);
    return true;
  }

  replaceChildren(/** @type {FakeElement[]} */ ...children) {
    this.children = children;
  }

  append(/** @type {any[]} */ ...parts) {
    for (const part of parts) {
      if (part instanceof FakeElement) this.children.push(part);
      else this.textContent += String(part);
    }
  }

  click() {
    this.dispatchEvent({ type: 'click' });
  }

  focus() {}
  setAttribute() {}
  removeAttribute() {}
}

/** Install the fake document (and Event, the element classes, confirm) on globalThis; returns its elements by id. */
export function fakeDocument() {
  /** @type {Map<string, FakeElement>} */
  const elements = new Map();
  const byId = (/** @type {string} */ id) => {
    if (!elements.has(id)) elements.set(id, new FakeElement(id));
    return /** @type {FakeElement} */ (elements.get(id));
  };
  Object.assign(globalThis, {
    document: {
      getElementById: byId,
      createElement: () => new FakeElement(),
      createElementNS: () => new FakeElement(),
      body: new FakeElement('body'),
    },
    Event: class {
      constructor(/** @type {string} */ type) {
        this.type = type;
      }
    },
    confirm: () => true,
  });
  for (const name of [
    'HTMLElement',
    'HTMLInputElement',
    'HTMLTextAreaElement',
    'HTMLButtonElement',
    'HTMLAnchorElement',
  ])
    Object.assign(globalThis, { [name]: FakeElement });
  Object.assign(globalThis, { HTMLSelectElement: FakeElement, HTMLProgressElement: FakeElement });
  return byId;
}
