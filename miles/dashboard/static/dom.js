// DOM helpers. Dynamic text only ever enters the page as text nodes or attribute values
// (never parsed as HTML): see the rule at the top of app.js.

const SVG_NS = "http://www.w3.org/2000/svg";

function build(node, attrs, children) {
  for (const [key, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "text") node.textContent = String(value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(typeof child === "string" || typeof child === "number" ? document.createTextNode(String(child)) : child);
  }
  return node;
}

/** An HTML element: `el("td", {class: "state", text: state})`; strings among children become text nodes. */
export function el(tag, attrs = {}, ...children) {
  return build(document.createElement(tag), attrs, children);
}

/** An SVG element, made in the SVG namespace. */
export function svg(tag, attrs = {}, ...children) {
  return build(document.createElementNS(SVG_NS, tag), attrs, children);
}

/** Sets an element's text only when it changed (keeps the DOM quiet between polls). */
export function setText(node, text) {
  const value = String(text);
  if (node.textContent !== value) node.textContent = value;
}

// ---- formatting --------------------------------------------------------------------

/** A metric value in at most ~4 significant digits; "—" when absent. */
export function formatNumber(value) {
  if (value === null || value === undefined || !Number.isFinite(value)) return "—";
  if (value === 0) return "0";
  const abs = Math.abs(value);
  if (abs >= 1e5 || abs < 1e-3) return value.toExponential(2);
  if (Number.isInteger(value)) return String(value);
  return String(Number(value.toPrecision(4)));
}

/** Seconds since the epoch as a local wall-clock time. */
export function formatTime(seconds) {
  if (!Number.isFinite(seconds)) return "—";
  return new Date(seconds * 1000).toLocaleTimeString();
}

// ---- colours -----------------------------------------------------------------------

const ADAPTER_PALETTE = [
  "#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c",
  "#0891b2", "#ca8a04", "#db2777", "#475569", "#65a30d",
];
const adapterColours = new Map();

/** One colour per adapter, the same in every view: assigned in the order adapters are first seen. */
export function adapterColour(name) {
  if (!adapterColours.has(name)) {
    adapterColours.set(name, ADAPTER_PALETTE[adapterColours.size % ADAPTER_PALETTE.length]);
  }
  return adapterColours.get(name);
}

/** A small coloured square (its colour set through CSSOM, which the CSP allows). */
export function swatch(colour) {
  const node = el("span", { class: "swatch" });
  node.style.backgroundColor = colour;
  return node;
}

/** A legend: one swatch and label per item. */
export function legend(items) {
  return el("ul", { class: "legend" },
    items.map(({ label, colour }) => el("li", {}, swatch(colour), label)));
}
