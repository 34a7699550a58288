// The adapters view: one row per adapter (updated in place), retire with a confirmation, register from YAML.

import { AuthError, request } from "./api.js";
import { sparkline } from "./charts.js";
import { adapterColour, el, formatNumber, setText, swatch } from "./dom.js";

const RETIRABLE = new Set(["QUEUED", "PENDING", "ACTIVE", "PAGED"]);

/** The curve shown in a row: the reward for RL adapters, the summed loss for client (Tinker) ones. */
function sparkMetric(kind) {
  return kind === "client" ? "loss:sum" : "raw_reward_mean";
}

/** An adapter's last_error as one line of text. */
function errorText(error) {
  if (!error) return "";
  if (typeof error === "string") return error;
  const head = error.error_type ? `${error.error_type}: ` : "";
  const groups = Number.isFinite(error.groups) ? ` (${error.groups} groups in a row)` : "";
  return `${head}${error.message ?? JSON.stringify(error)}${groups}`;
}

export class AdaptersView {
  /** onAuthError(error): the API said 401; refresh(): poll again now (after a register or retire). */
  constructor({ onAuthError, refresh }) {
    this.onAuthError = onAuthError;
    this.refresh = refresh;
    this.body = document.getElementById("adapters-body");
    this.message = document.getElementById("adapters-message");
    this.rows = new Map(); // name -> {row, cells, drawnPoints, drawnKind}
    this.controls = false;
    this.dialog = document.getElementById("confirm-dialog");
    this.retiring = null;

    document.getElementById("confirm-retire").addEventListener("click", () => this.retire());
    document.getElementById("cancel-retire").addEventListener("click", () => this.dialog.close());
    this.dialog.addEventListener("close", () => { this.retiring = null; });
    document.getElementById("register-button").addEventListener("click", () => this.register());
  }

  update(ctx) {
    this.controls = Boolean(ctx.info.controls);
    document.getElementById("register-panel").hidden = !this.controls;
    document.getElementById("read-only-note").hidden = this.controls;
    const hidden = ctx.adapterRunsTotal - ctx.adapterRuns.length;
    setText(document.getElementById("adapter-runs-error"),
      ctx.adapterRunsError ? `Adapter list unavailable: ${ctx.adapterRunsError}`
        : hidden > 0 ? `${hidden} older finished adapters not shown (GET /adapter_runs?offset= lists them)` : "");

    // The control plane's adapters in its order, then any adapter known only from the records.
    const statuses = new Map(ctx.adapterRuns.map((s) => [s.name, s]));
    const names = [...statuses.keys(), ...[...ctx.store.adapters.keys()].filter((n) => !statuses.has(n))];
    const shown = new Set(names);
    for (const [name, entry] of this.rows) {
      if (!shown.has(name)) {
        entry.row.remove();
        this.rows.delete(name);
      }
    }
    names.forEach((name, i) => {
      const entry = this.rows.get(name) ?? this.addRow(name);
      this.fill(entry, statuses.get(name) ?? null, ctx.store.adapters.get(name) ?? null);
      if (this.body.children[i] !== entry.row) this.body.insertBefore(entry.row, this.body.children[i] ?? null);
    });
    setText(document.getElementById("adapters-empty"),
      names.length ? "" : "No adapters yet." + (this.controls ? " Register one below." : ""));
  }

  addRow(name) {
    const cell = (cls) => el("td", { class: cls });
    const cells = {
      name: el("td", { class: "name" }, swatch(adapterColour(name)), el("span", { text: name })),
      kind: cell("kind"), state: cell("state"), slot: cell("slot num"), version: cell("version num"),
      step: cell("step num"), numStep: cell("num-step num"), spark: cell("spark"),
      samples: cell("samples-per-s num"), staleness: cell("staleness num"), error: cell("error"),
      actions: cell("actions"),
    };
    const row = el("tr", { "data-adapter": name }, Object.values(cells));
    const entry = { name, row, cells, drawnPoints: -1, drawnKind: null, button: null };
    this.rows.set(name, entry);
    return entry;
  }

  fill(entry, status, series) {
    const { cells } = entry;
    const kind = status?.kind ?? series?.kind ?? "server";
    const state = status?.state ?? "";
    setText(cells.kind, kind);
    // A queued registration shows its place: #1 takes the next slot that frees.
    const position = state === "QUEUED" && status?.queue_position ? ` #${status.queue_position}` : "";
    setText(cells.state, state ? `${state}${position}` : "—");
    entry.row.dataset.state = state;
    cells.state.dataset.state = state;
    setText(cells.slot, status ? formatNumber(status.slot) : "—");
    setText(cells.version, formatNumber(status?.version ?? null));
    const lastStep = series?.points.length ? series.points[series.points.length - 1].step : null;
    setText(cells.step, formatNumber(status?.step ?? lastStep));
    setText(cells.numStep, formatNumber(status?.num_step ?? null));
    setText(cells.samples, formatNumber(series?.latest("perf/samples_per_s") ?? null));
    setText(cells.staleness, formatNumber(series?.latest("avg_staleness") ?? null));
    const error = errorText(status?.last_error);
    setText(cells.error, error);
    cells.error.title = status?.last_error?.reason ? `reason: ${status.last_error.reason}` : "";

    const points = series?.points.length ?? 0;
    if (points !== entry.drawnPoints || kind !== entry.drawnKind) {
      const metric = sparkMetric(kind);
      const values = series ? series.series(metric).slice(-200) : [];
      const line = sparkline(values, adapterColour(entry.name));
      cells.spark.replaceChildren(line, el("span", { class: "spark-value", text: formatNumber(values.at(-1)?.[1]) }));
      cells.spark.title = metric;
      entry.drawnPoints = points;
      entry.drawnKind = kind;
    }

    const retirable = this.controls && RETIRABLE.has(state);
    if (retirable && !entry.button) {
      entry.button = el("button", { type: "button", class: "retire-button", text: "Retire" });
      entry.button.addEventListener("click", () => this.confirmRetire(entry.name));
      cells.actions.append(entry.button);
    } else if (!retirable && entry.button) {
      entry.button.remove();
      entry.button = null;
    }
  }

  confirmRetire(name) {
    this.retiring = name;
    setText(document.getElementById("confirm-text"), `Retire ${name}?`);
    this.dialog.showModal();
  }

  async retire() {
    const name = this.retiring;
    this.dialog.close();
    if (!name) return;
    try {
      await request(`/adapter_runs/${encodeURIComponent(name)}`, { method: "DELETE" });
      this.say(`Retiring ${name}.`, "ok");
    } catch (error) {
      if (error instanceof AuthError) return this.onAuthError(error);
      this.say(`Retire ${name}: ${error.message}`, "error");
    }
    this.refresh();
  }

  async register() {
    const result = document.getElementById("register-result");
    const button = document.getElementById("register-button");
    const yaml = document.getElementById("register-yaml").value;
    button.disabled = true;
    result.dataset.outcome = "pending";
    setText(result, "Registering…");
    try {
      const answer = await request("/adapter_runs", { method: "POST", body: yaml, contentType: "application/yaml" });
      result.dataset.outcome = "ok";
      setText(result, answer.state === "QUEUED"
        ? `Queued ${answer.name} at position ${answer.queue_position}: every slot is held; it takes the next one that frees.`
        : `Registered ${answer.name} in slot ${answer.slot}.`);
      this.refresh();
    } catch (error) {
      result.dataset.outcome = "error";
      setText(result, error.message);
      if (error instanceof AuthError) this.onAuthError(error);
    } finally {
      button.disabled = false;
    }
  }

  say(text, outcome) {
    this.message.dataset.outcome = outcome;
    setText(this.message, text);
  }
}
