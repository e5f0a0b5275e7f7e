/**
 * Tiny DOM helpers. Everything the dashboard shows is built with createElement/textContent so that layer
 * names, run names and diagnosis reasons (which come from user code) can never be interpreted as HTML.
 */

/**
 * Create an element. `props` keys: `class`, `text`, `title`, `attrs` (object of attributes), `on` (object of
 * event listeners), `style` (object of style properties), any other key is assigned as a DOM property.
 * Children may be nodes, strings (become text nodes), or null/false (skipped).
 */
export function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null) continue;
    if (key === 'class') node.className = value;
    else if (key === 'text') node.textContent = String(value);
    else if (key === 'attrs') for (const [a, v] of Object.entries(value)) node.setAttribute(a, String(v));
    else if (key === 'on') for (const [ev, fn] of Object.entries(value)) node.addEventListener(ev, fn);
    else if (key === 'style') Object.assign(node.style, value);
    else node[key] = value;
  }
  append(node, children);
  return node;
}

/** Append children (nodes, strings, nested arrays; null/false skipped). */
export function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.appendChild(typeof child === 'object' ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** Remove every child of `node` (clearing without any HTML parsing). */
export function clear(node) {
  while (node.firstChild) node.removeChild(node.firstChild);
  return node;
}

/** Replace the children of `node`. */
export function replace(node, ...children) {
  clear(node);
  return append(node, children);
}

/** Call `fn` at most once per `ms` after the last call (for sliders and text filters). */
export function debounce(fn, ms) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), ms);
  };
}
