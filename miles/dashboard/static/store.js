// The run's metrics.jsonl as the page holds it: fetched incrementally by byte offset, kept per adapter.

/** One adapter's records, in step order. */
class AdapterSeries {
  constructor(name, kind) {
    this.name = name;
    this.kind = kind;
    this.points = []; // {step, time, metrics}
  }

  add(record) {
    // A step logged again (a trainer restarted from an older checkpoint) replaces what followed it.
    while (this.points.length && this.points[this.points.length - 1].step >= record.step) this.points.pop();
    this.points.push({ step: record.step, time: record.time, metrics: record.metrics ?? {} });
    if (record.adapter_kind) this.kind = record.adapter_kind;
  }

  /** [[step, value], ...] for the records where `metric` is a finite number. */
  series(metric) {
    const out = [];
    for (const p of this.points) {
      const value = p.metrics[metric];
      if (typeof value === "number" && Number.isFinite(value)) out.push([p.step, value]);
    }
    return out;
  }

  /** The newest finite value of `metric`, or null. */
  latest(metric) {
    for (let i = this.points.length - 1; i >= 0; i--) {
      const value = this.points[i].metrics[metric];
      if (typeof value === "number" && Number.isFinite(value)) return value;
    }
    return null;
  }
}

export class RecordStore {
  constructor() {
    this.version = 0; // moves whenever the data changes; views redraw only then
    this.clear();
  }

  clear() {
    this.offset = 0;
    this.adapters = new Map(); // name -> AdapterSeries, in the order first seen
    this.loop = []; // loop records in rollout_id order
    this.metricNames = new Set(); // numeric adapter metric names seen
  }

  /** Fetches what metrics.jsonl gained since the last call (all of it, page by page). */
  async poll(request) {
    for (;;) {
      const page = await request(`/ui/api/records?offset=${this.offset}`);
      if (page.reset) this.clear();
      for (const record of page.records) this.add(record);
      if (page.reset || page.records.length) this.version++;
      this.offset = page.offset;
      if (!page.more) return;
    }
  }

  add(record) {
    if (record.kind === "loop") {
      while (this.loop.length && this.loop[this.loop.length - 1].rollout_id >= record.rollout_id) this.loop.pop();
      this.loop.push({ rollout_id: record.rollout_id, time: record.time, metrics: record.metrics ?? {},
                       batch: record.batch ?? null });
    } else if (record.kind === "adapter" && typeof record.adapter === "string") {
      let series = this.adapters.get(record.adapter);
      if (!series) {
        series = new AdapterSeries(record.adapter, record.adapter_kind ?? "server");
        this.adapters.set(record.adapter, series);
      }
      series.add(record);
      for (const [name, value] of Object.entries(record.metrics ?? {})) {
        if (typeof value === "number" && Number.isFinite(value)) this.metricNames.add(name);
      }
    }
  }
}

// The metrics most worth a look, in the order the curves view lists them; the rest follow by name.
const METRIC_PRIORITY = [
  (m) => m === "raw_reward_mean",
  (m) => m === "response_len_mean",
  (m) => m === "loss",
  (m) => m.startsWith("kl"),
  (m) => m.includes("kl") && !m.startsWith("perf/"),
  (m) => m === "pg_clipfrac",
  (m) => m === "grad_norm",
  (m) => m === "lr",
  (m) => m === "zero_std_all_zero_percentage",
  (m) => m === "zero_std_all_one_percentage",
  (m) => m === "truncated_ratio",
  (m) => m === "avg_staleness",
  (m) => m === "perf/groups_filtered",
  (m) => m.startsWith("perf/dynamic_filter/"),
  (m) => m === "log_probs",
  (m) => m === "loss:sum",
];

function metricRank(name) {
  const rank = METRIC_PRIORITY.findIndex((matches) => matches(name));
  return rank === -1 ? METRIC_PRIORITY.length : rank;
}

/** Metric names with the important ones first, then alphabetically. */
export function sortMetrics(names) {
  return [...names].sort((a, b) => metricRank(a) - metricRank(b) || a.localeCompare(b));
}
