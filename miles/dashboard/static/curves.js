// The curves view: one metric, chosen adapters, overlaid against each adapter's own step.

import { LineChart } from "./charts.js";
import { adapterColour, el, swatch } from "./dom.js";
import { sortMetrics } from "./store.js";

export class CurvesView {
  constructor() {
    this.select = document.getElementById("curve-metric");
    this.adapterBox = document.getElementById("curve-adapters");
    this.resetButton = document.getElementById("curve-reset");
    this.chart = new LineChart(document.getElementById("curve-chart"), document.getElementById("curve-tooltip"), {
      onZoom: (zoom) => { this.resetButton.disabled = zoom === null; },
    });
    this.checkboxes = new Map(); // adapter name -> input.curve-adapter
    this.metricCount = -1;
    this.drawnVersion = -1;
    this.store = null;

    this.select.addEventListener("change", () => {
      this.chart.zoom = null;
      this.resetButton.disabled = true;
      this.draw();
    });
    this.adapterBox.addEventListener("change", () => this.draw());
    this.resetButton.addEventListener("click", () => this.chart.resetZoom());
  }

  update(ctx) {
    this.store = ctx.store;
    this.syncMetrics();
    this.syncAdapters();
    if (this.drawnVersion !== this.store.version) this.draw();
  }

  resize() {
    if (this.store) this.draw();
  }

  syncMetrics() {
    const names = this.store.metricNames;
    if (names.size === this.metricCount) return;
    this.metricCount = names.size;
    const chosen = this.select.value;
    const options = sortMetrics(names).map((name) => el("option", { value: name, text: name }));
    this.select.replaceChildren(...options);
    if (chosen && names.has(chosen)) this.select.value = chosen;
  }

  syncAdapters() {
    const names = [...this.store.adapters.keys()];
    for (const [name, box] of this.checkboxes) {
      if (!this.store.adapters.has(name)) {
        box.closest("label").remove();
        this.checkboxes.delete(name);
      }
    }
    for (const name of names) {
      if (this.checkboxes.has(name)) continue;
      const box = el("input", { type: "checkbox", class: "curve-adapter", value: name, checked: true });
      this.checkboxes.set(name, box);
      this.adapterBox.append(el("label", { class: "curve-adapter-label" }, box, swatch(adapterColour(name)),
                                el("span", { text: name })));
    }
  }

  draw() {
    this.drawnVersion = this.store.version;
    const metric = this.select.value;
    const series = [];
    for (const [name, box] of this.checkboxes) {
      if (!box.checked || !metric) continue;
      series.push({ name, colour: adapterColour(name), points: this.store.adapters.get(name).series(metric) });
    }
    this.chart.setSeries(series);
  }
}
