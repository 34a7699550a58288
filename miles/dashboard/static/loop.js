// The loop view: each iteration's stage times as a stacked bar, and the batch's composition by adapter.

import { StackedBars } from "./charts.js";
import { adapterColour } from "./dom.js";

const SHOWN_ITERATIONS = 100;

// The loop's stages in the order they run, and what the rest of perf/iteration_time is called.
const STAGES = [
  { key: "snapshot", label: "snapshot", colour: "#a78bfa" },
  { key: "reconcile", label: "reconcile", colour: "#f472b6" },
  { key: "update_weights", label: "push (update_weights)", colour: "#f59e0b" },
  { key: "generate", label: "generate", colour: "#3b82f6" },
  { key: "export_wait", label: "export wait", colour: "#7dd3fc" },
  { key: "train", label: "train", colour: "#22c55e" },
  { key: "client", label: "client", colour: "#14b8a6" },
  { key: "commit", label: "commit", colour: "#64748b" },
  { key: "save", label: "save", colour: "#ef4444" },
  { key: "push_wait", label: "push wait", colour: "#a16207" },
];
const OTHER = { label: "other", colour: "#d4d4d8" };

function stageSeries(iterations) {
  const series = STAGES.map(({ key, label, colour }) => ({
    name: label, colour, values: iterations.map((r) => r.metrics[`perf/${key}_time`] ?? 0),
  })).filter((s) => s.values.some((v) => v > 0));
  const other = iterations.map((r, i) => {
    const total = r.metrics["perf/iteration_time"];
    if (!Number.isFinite(total)) return 0;
    return Math.max(0, total - series.reduce((sum, s) => sum + s.values[i], 0));
  });
  if (other.some((v) => v > 0)) series.push({ name: OTHER.label, colour: OTHER.colour, values: other });
  return series;
}

function batchSeries(iterations, unit) {
  const names = [];
  for (const r of iterations) {
    for (const name of Object.keys(r.batch ?? {})) if (!names.includes(name)) names.push(name);
  }
  return names.map((name) => ({
    name, colour: adapterColour(name), values: iterations.map((r) => r.batch?.[name]?.[unit] ?? 0),
  }));
}

export class LoopView {
  constructor() {
    this.stages = new StackedBars(document.getElementById("loop-chart"), document.getElementById("loop-tooltip"),
                                  { xLabel: "rollout", unit: "s" });
    this.batch = new StackedBars(document.getElementById("batch-chart"), document.getElementById("batch-tooltip"),
                                 { xLabel: "rollout", height: 220 });
    this.unitSelect = document.getElementById("batch-unit");
    this.unitSelect.addEventListener("change", () => this.draw());
    this.drawnVersion = -1;
    this.store = null;
  }

  update(ctx) {
    this.store = ctx.store;
    if (this.drawnVersion !== this.store.version) this.draw();
  }

  resize() {
    if (this.store) this.draw();
  }

  draw() {
    this.drawnVersion = this.store.version;
    const iterations = this.store.loop.slice(-SHOWN_ITERATIONS);
    const categories = iterations.map((r) => r.rollout_id);
    this.stages.setData({ categories, series: stageSeries(iterations) });
    const unit = this.unitSelect.value;
    this.batch.setData({ categories, series: batchSeries(iterations, unit), unit });
    document.getElementById("batch-missing").hidden = !iterations.length || iterations.some((r) => r.batch);
  }
}
