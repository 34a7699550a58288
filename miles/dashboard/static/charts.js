// Charts drawn as SVG with createElementNS: a sparkline, a line chart with hover and
// drag-to-zoom, and a stacked bar chart. Labels enter as text nodes only.

import { el, formatNumber, legend, svg, swatch } from "./dom.js";

const MARGIN = { top: 12, right: 18, bottom: 34, left: 62 };
let clipCount = 0;

/** About `count` round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten). */
export function niceTicks(lo, hi, count = 6, { integer = false } = {}) {
  if (!(hi > lo)) return [lo];
  const raw = (hi - lo) / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  let step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
  if (integer) step = Math.max(1, Math.round(step));
  const ticks = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) ticks.push(Number(v.toPrecision(12)));
  return ticks;
}

function linear(d0, d1, r0, r1) {
  const k = (r1 - r0) / (d1 - d0);
  const f = (v) => r0 + (v - d0) * k;
  f.invert = (p) => d0 + (p - r0) / k;
  return f;
}

function extent(values) {
  let lo = Infinity;
  let hi = -Infinity;
  for (const v of values) {
    if (v < lo) lo = v;
    if (v > hi) hi = v;
  }
  return [lo, hi];
}

/** Shows `tooltip` (absolutely placed inside `container`) with `lines` near (x, y), kept inside the box. */
function showTooltip(tooltip, container, x, y, lines) {
  tooltip.replaceChildren(...lines);
  tooltip.hidden = false;
  const box = container.getBoundingClientRect();
  const tip = tooltip.getBoundingClientRect();
  const left = x + 14 + tip.width > box.width ? x - 14 - tip.width : x + 14;
  const top = Math.min(Math.max(y - tip.height / 2, 0), box.height - tip.height);
  tooltip.style.left = `${Math.max(left, 0)}px`;
  tooltip.style.top = `${Math.max(top, 0)}px`;
}

function drawAxes(layer, plot, xTicks, yTicks, sx, sy, xFormat) {
  const grid = svg("g", { class: "grid" });
  const labels = svg("g", { class: "tick-labels" });
  for (const t of yTicks) {
    const y = sy(t);
    grid.append(svg("line", { x1: plot.left, x2: plot.right, y1: y, y2: y }));
    labels.append(svg("text", { x: plot.left - 6, y, "text-anchor": "end", "dominant-baseline": "middle",
                                text: formatNumber(t) }));
  }
  for (const t of xTicks) {
    const x = sx(t);
    grid.append(svg("line", { class: "x-tick", x1: x, x2: x, y1: plot.bottom, y2: plot.bottom + 4 }));
    labels.append(svg("text", { x, y: plot.bottom + 16, "text-anchor": "middle", text: xFormat(t) }));
  }
  const axis = svg("path", { class: "axis", d: `M${plot.left},${plot.top}V${plot.bottom}H${plot.right}` });
  layer.append(grid, axis, labels);
}

/** An inline SVG line of [[x, y], ...] (the last point marked), or an empty box when there are none. */
export function sparkline(points, colour, { width = 120, height = 26 } = {}) {
  const root = svg("svg", { class: "sparkline", width, height, viewBox: `0 0 ${width} ${height}` });
  if (!points.length) return root;
  const [x0, x1] = extent(points.map((p) => p[0]));
  const [y0, y1] = extent(points.map((p) => p[1]));
  const sx = x1 > x0 ? linear(x0, x1, 2, width - 4) : () => width / 2;
  const sy = y1 > y0 ? linear(y0, y1, height - 3, 3) : () => height / 2;
  const d = points.map(([x, y], i) => `${i ? "L" : "M"}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join("");
  const [lx, ly] = points[points.length - 1];
  root.append(svg("path", { d, stroke: colour }), svg("circle", { cx: sx(lx), cy: sy(ly), r: 2.2, fill: colour }));
  return root;
}

/**
 * Overlaid lines against a shared x axis. Hover shows the nearest point; dragging across the
 * plot zooms the x axis to that range (y fits the visible points); double-click resets.
 */

/** Size a chart's SVG to its container, clear it and its hover, and return (and keep) its plot area. */
function startFrame(chart) {
  const width = Math.max(chart.container.clientWidth, 240);
  chart.root.setAttribute("width", width);
  chart.root.setAttribute("height", chart.height);
  chart.layer.replaceChildren();
  chart.hideHover();
  chart.plot = { left: MARGIN.left, top: MARGIN.top, right: width - MARGIN.right,
                 bottom: chart.height - MARGIN.bottom };
  return chart.plot;
}
export class LineChart {
  constructor(container, tooltip, { height = 380, xLabel = "step", onZoom = () => {} } = {}) {
    this.container = container;
    this.tooltip = tooltip;
    this.height = height;
    this.xLabel = xLabel;
    this.onZoom = onZoom;
    this.series = []; // [{name, colour, points: [[x, y], ...]}]
    this.zoom = null; // [x0, x1] or null for everything
    this.hoverPoints = [];
    this.plot = null;
    this.drag = null;
    this.pointer = null; // the mouse's last position over the plot: a redraw shows its tooltip again
    this.clipId = `chart-clip-${++clipCount}`;

    this.root = svg("svg", { class: "chart line-chart" });
    this.layer = svg("g");
    this.brush = svg("rect", { class: "brush", visibility: "hidden" });
    this.marker = svg("circle", { class: "marker", r: 4.5, visibility: "hidden" });
    this.root.append(this.layer, this.brush, this.marker);
    this.legendBox = el("div", { class: "legend-box" });
    container.prepend(this.root);
    container.append(this.legendBox);
    this.listen();
  }

  setSeries(series) {
    this.series = series;
    this.render();
  }

  resetZoom() {
    this.zoom = null;
    this.onZoom(null);
    this.render();
  }

  render() {
    const plot = startFrame(this);
    const width = plot.right + MARGIN.right;
    const height = this.height;
    this.hoverPoints = [];
    const drawn = this.series.filter((s) => s.points.length);
    this.legendBox.replaceChildren(legend(drawn.map((s) => ({ label: s.name, colour: s.colour }))));
    if (!drawn.length) {
      this.layer.append(svg("text", { class: "empty", x: width / 2, y: height / 2, "text-anchor": "middle",
                                      text: "No data for this metric and these adapters yet." }));
      return;
    }

    let [x0, x1] = this.zoom ?? extent(drawn.flatMap((s) => s.points.map((p) => p[0])));
    if (x0 === x1) [x0, x1] = [x0 - 1, x1 + 1];
    const inView = drawn.flatMap((s) => s.points.filter((p) => p[0] >= x0 && p[0] <= x1).map((p) => p[1]));
    let [y0, y1] = inView.length ? extent(inView) : [0, 1];
    const pad = y1 > y0 ? (y1 - y0) * 0.06 : Math.abs(y0) * 0.1 || 1;
    [y0, y1] = [y0 - pad, y1 + pad];
    const sx = linear(x0, x1, plot.left, plot.right);
    const sy = linear(y0, y1, plot.bottom, plot.top);
    const integerSteps = drawn.every((s) => s.points.every((p) => Number.isInteger(p[0])));
    const xTicks = niceTicks(x0, x1, Math.max(2, Math.floor((plot.right - plot.left) / 80)), { integer: integerSteps });
    drawAxes(this.layer, plot, xTicks, niceTicks(y0, y1, 6), sx, sy, formatNumber);
    this.layer.append(svg("text", { class: "axis-label", x: plot.right, y: height - 4, "text-anchor": "end",
                                    text: this.xLabel }));

    const clip = svg("clipPath", { id: this.clipId },
      svg("rect", { x: plot.left, y: plot.top - 5, width: plot.right - plot.left, height: plot.bottom - plot.top + 10 }));
    const lines = svg("g", { class: "lines", "clip-path": `url(#${this.clipId})` });
    for (const s of drawn) {
      // The points in view and one on each side, so lines run to the edges of a zoomed plot.
      const first = Math.max(0, s.points.findIndex((p) => p[0] >= x0) - 1);
      let last = s.points.findLastIndex((p) => p[0] <= x1) + 1;
      if (last <= 0) last = s.points.length - 1;
      const shown = s.points.slice(first, last + 1);
      const d = shown.map(([x, y], i) => `${i ? "L" : "M"}${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join("");
      if (shown.length === 1) lines.append(svg("circle", { cx: sx(shown[0][0]), cy: sy(shown[0][1]), r: 3, fill: s.colour }));
      else lines.append(svg("path", { class: "series", d, stroke: s.colour }));
      for (const [x, y] of shown) {
        if (x >= x0 && x <= x1) this.hoverPoints.push({ px: sx(x), py: sy(y), x, y, series: s });
      }
    }
    this.layer.append(svg("defs", {}, clip), lines);
    this.scaleX = sx;
    if (this.pointer && !this.drag) this.hover(...this.pointer);
  }

  listen() {
    const local = (event) => {
      const box = this.root.getBoundingClientRect();
      return [event.clientX - box.left, event.clientY - box.top];
    };
    const inPlot = (x, y) => this.plot && x >= this.plot.left && x <= this.plot.right &&
      y >= this.plot.top && y <= this.plot.bottom;

    this.root.addEventListener("mousedown", (event) => {
      const [x, y] = local(event);
      if (event.button !== 0 || !inPlot(x, y) || !this.hoverPoints.length) return;
      event.preventDefault();
      this.drag = { start: x, end: x };
      this.hideHover();
    });
    this.root.addEventListener("mousemove", (event) => {
      const [x, y] = local(event);
      if (this.drag) {
        this.drag.end = Math.min(Math.max(x, this.plot.left), this.plot.right);
        const lo = Math.min(this.drag.start, this.drag.end);
        this.brush.setAttribute("x", lo);
        this.brush.setAttribute("y", this.plot.top);
        this.brush.setAttribute("width", Math.abs(this.drag.end - this.drag.start));
        this.brush.setAttribute("height", this.plot.bottom - this.plot.top);
        this.brush.setAttribute("visibility", "visible");
      } else if (inPlot(x, y)) {
        this.pointer = [x, y];
        this.hover(x, y);
      } else {
        this.pointer = null;
        this.hideHover();
      }
    });
    this.root.addEventListener("mouseleave", () => {
      this.pointer = null;
      this.hideHover();
    });
    window.addEventListener("mouseup", () => {
      if (!this.drag) return;
      const { start, end } = this.drag;
      this.drag = null;
      this.brush.setAttribute("visibility", "hidden");
      if (Math.abs(end - start) < 5) return;
      this.zoom = [this.scaleX.invert(Math.min(start, end)), this.scaleX.invert(Math.max(start, end))];
      this.onZoom(this.zoom);
      this.render();
    });
    this.root.addEventListener("dblclick", () => this.resetZoom());
  }

  hover(x, y) {
    let best = null;
    let bestDistance = Infinity;
    for (const p of this.hoverPoints) {
      const distance = (p.px - x) ** 2 + (p.py - y) ** 2;
      if (distance < bestDistance) [best, bestDistance] = [p, distance];
    }
    if (!best) return this.hideHover();
    this.marker.setAttribute("cx", best.px);
    this.marker.setAttribute("cy", best.py);
    this.marker.setAttribute("stroke", best.series.colour);
    this.marker.setAttribute("visibility", "visible");
    showTooltip(this.tooltip, this.container, best.px, best.py, [
      el("div", { class: "tooltip-title" }, swatch(best.series.colour), best.series.name),
      el("div", {}, `${this.xLabel} ${formatNumber(best.x)}`),
      el("div", { class: "tooltip-value" }, formatNumber(best.y)),
    ]);
  }

  hideHover() {
    this.marker.setAttribute("visibility", "hidden");
    this.tooltip.hidden = true;
  }
}

/**
 * One stacked bar per category (e.g. per rollout id), oldest left. Hover shows the bar's parts.
 * series: [{name, colour, values}] with values[i] the part of category i (missing: 0).
 */
export class StackedBars {
  constructor(container, tooltip, { height = 280, xLabel = "", unit = "" } = {}) {
    this.container = container;
    this.tooltip = tooltip;
    this.height = height;
    this.xLabel = xLabel;
    this.unit = unit;
    this.data = { categories: [], series: [] };
    this.root = svg("svg", { class: "chart bar-chart" });
    this.layer = svg("g");
    this.highlight = svg("rect", { class: "bar-highlight", visibility: "hidden" });
    this.root.append(this.layer, this.highlight);
    this.legendBox = el("div", { class: "legend-box" });
    container.prepend(this.root);
    container.append(this.legendBox);
    this.pointer = null; // the mouse's last position: a redraw shows its tooltip again
    this.root.addEventListener("mousemove", (event) => {
      const box = this.root.getBoundingClientRect();
      this.pointer = [event.clientX - box.left, event.clientY - box.top];
      this.hover(...this.pointer);
    });
    this.root.addEventListener("mouseleave", () => {
      this.pointer = null;
      this.hideHover();
    });
  }

  setData({ categories, series, unit = this.unit }) {
    this.data = { categories, series };
    this.unit = unit;
    this.render();
  }

  render() {
    const { categories, series } = this.data;
    const plot = startFrame(this);
    const width = plot.right + MARGIN.right;
    const height = this.height;
    this.legendBox.replaceChildren(legend(series.map((s) => ({ label: s.name, colour: s.colour }))));
    if (!categories.length) {
      this.layer.append(svg("text", { class: "empty", x: width / 2, y: height / 2, "text-anchor": "middle",
                                      text: "No iterations recorded yet." }));
      return;
    }
    const totals = categories.map((_, i) => series.reduce((sum, s) => sum + (s.values[i] || 0), 0));
    const top = Math.max(...totals) || 1;
    const yTicks = niceTicks(0, top, 5);
    const yMax = Math.max(top, yTicks[yTicks.length - 1]);
    const sy = linear(0, yMax, plot.bottom, plot.top);
    this.band = (plot.right - plot.left) / categories.length;
    const sx = (i) => plot.left + this.band * (i + 0.5);
    const every = Math.max(1, Math.ceil(56 / this.band));
    const xTicks = categories.map((_, i) => i).filter((i) => (categories.length - 1 - i) % every === 0);
    drawAxes(this.layer, plot, xTicks, yTicks, sx, sy, (i) => String(categories[i]));
    this.layer.append(svg("text", { class: "axis-label", x: plot.right, y: height - 4, "text-anchor": "end",
                                    text: this.xLabel }));

    const bars = svg("g", { class: "bars" });
    const barWidth = Math.max(1, this.band * 0.8);
    categories.forEach((_, i) => {
      let base = 0;
      for (const s of series) {
        const value = s.values[i] || 0;
        if (value <= 0) continue;
        const y = sy(base + value);
        bars.append(svg("rect", { x: sx(i) - barWidth / 2, y, width: barWidth, height: Math.max(sy(base) - y, 0.5),
                                  fill: s.colour }));
        base += value;
      }
    });
    this.layer.append(bars);
    this.totals = totals;
    if (this.pointer) this.hover(...this.pointer);
  }

  hover(x, y) {
    const { categories, series } = this.data;
    const plot = this.plot;
    if (!categories.length || x < plot.left || x > plot.right || y < plot.top || y > plot.bottom) {
      return this.hideHover();
    }
    const i = Math.min(categories.length - 1, Math.floor((x - plot.left) / this.band));
    this.highlight.setAttribute("x", plot.left + this.band * i);
    this.highlight.setAttribute("y", plot.top);
    this.highlight.setAttribute("width", this.band);
    this.highlight.setAttribute("height", plot.bottom - plot.top);
    this.highlight.setAttribute("visibility", "visible");
    const unit = this.unit ? ` ${this.unit}` : "";
    const rows = series.filter((s) => (s.values[i] || 0) > 0).reverse().map((s) =>
      el("div", { class: "tooltip-row" }, swatch(s.colour), el("span", { text: s.name }),
         el("span", { class: "tooltip-number", text: `${formatNumber(s.values[i])}${unit}` })));
    showTooltip(this.tooltip, this.container, plot.left + this.band * (i + 1), y, [
      el("div", { class: "tooltip-title", text: `${this.xLabel} ${categories[i]}` }),
      ...rows,
      el("div", { class: "tooltip-row tooltip-total" }, el("span", { text: "total" }),
         el("span", { class: "tooltip-number", text: `${formatNumber(this.totals[i])}${unit}` })),
    ]);
  }

  hideHover() {
    this.highlight.setAttribute("visibility", "hidden");
    this.tooltip.hidden = true;
  }
}
