// The rollouts view: an adapter's dumped rollouts, each group's prompt and responses token by token.

import { ApiError, request } from "./api.js";
import { el, formatNumber, formatTime, setText } from "./dom.js";

// Probability buckets for token shading (CSS classes p1..p5): a less likely token is shaded stronger.
const PROBABILITY_FLOORS = [0.9, 0.7, 0.5, 0.3, 0.1];

function probabilityClass(logprob) {
  const p = Math.exp(logprob);
  const bucket = PROBABILITY_FLOORS.findIndex((floor) => p >= floor);
  return bucket === -1 ? "p5" : bucket === 0 ? "" : `p${bucket}`;
}

function tokenSpans(sample) {
  const tokens = sample.tokens ?? [];
  const fragment = document.createDocumentFragment();
  tokens.forEach((text, i) => {
    const span = el("span", { class: "token", text });
    const logprob = sample.logprobs?.[i];
    if (typeof logprob === "number" && Number.isFinite(logprob)) {
      const shade = probabilityClass(logprob);
      if (shade) span.classList.add(shade);
      span.title = `logprob ${logprob.toFixed(3)} · p ${Math.exp(logprob).toFixed(3)}`;
    }
    if (sample.loss_mask && sample.loss_mask[i] === 0) {
      span.classList.add("masked");
      span.title = `${span.title ? `${span.title} · ` : ""}not trained (loss_mask 0)`;
    }
    fragment.append(span);
  });
  return fragment;
}

function sampleView(sample) {
  // The flags, where the status does not already say them.
  const flags = ["truncated", "aborted"].filter((flag) => sample[flag] && sample.status !== flag)
    .map((flag) => el("span", { class: "flag", text: flag }));
  const head = el("div", { class: "sample-head" },
    el("span", { class: "sample-index", text: `#${sample.index}` }),
    el("span", { class: "reward" }, "reward ", el("b", { text: formatNumber(sample.reward) })),
    el("span", { class: "advantage" }, "advantage ", el("b", { text: formatNumber(sample.advantage) })),
    el("span", { class: "status", "data-status": sample.status ?? "", text: sample.status ?? "" }),
    flags);
  const body = sample.tokens?.length
    ? el("div", { class: "tokens" }, tokenSpans(sample))
    : el("div", { class: "tokens plain", text: sample.response ?? "" });
  return el("div", { class: "sample" }, head, body);
}

function groupView(group) {
  return el("section", { class: "rollout-group" },
    el("h3", { text: `Group ${group.group_index} · policy version ${formatNumber(group.version)}` }),
    el("div", { class: "field-label", text: "prompt" }),
    el("pre", { class: "prompt", text: group.prompt ?? "" }),
    group.label === null || group.label === undefined ? null : el("div", { class: "label-line" },
      el("span", { class: "field-label", text: "label " }), el("code", { text: String(group.label) })),
    (group.samples ?? []).map(sampleView));
}

const SHADING_KEY = el("div", { class: "shading-key" },
  "token probability: ",
  ["≥ 0.9", "0.7", "0.5", "0.3", "0.1", "< 0.1"].map((label, i) =>
    el("span", { class: `token${i ? ` p${i}` : ""}`, text: label })),
  el("span", { class: "token masked", text: "not trained (loss_mask 0)" }));

export class RolloutsView {
  /** refresh(): poll again now (after the user picks an adapter or a rollout). */
  constructor({ refresh }) {
    this.refresh = refresh;
    this.disabled = document.getElementById("rollouts-disabled");
    this.content = document.getElementById("rollouts-content");
    this.select = document.getElementById("rollout-adapter");
    this.list = document.getElementById("rollout-list");
    this.doc = document.getElementById("rollout-doc");
    this.listError = document.getElementById("rollout-list-error");
    this.adapterNames = [];
    this.rollouts = []; // the chosen adapter's list, oldest first
    this.listKey = "";
    this.picked = null; // a rollout id the user opened; null follows the newest
    this.shown = null; // "adapter/rollout_id" of the document on screen
    this.select.addEventListener("change", () => {
      this.picked = null;
      this.listKey = "";
      this.refresh();
    });
  }

  async update(ctx) {
    const enabled = Boolean(ctx.info.dump_dir);
    this.disabled.hidden = enabled;
    this.content.hidden = !enabled;
    if (!enabled) return;
    this.syncAdapters([...new Set([...ctx.adapterRuns.map((s) => s.name), ...ctx.store.adapters.keys()])]);
    const adapter = this.select.value;
    if (!adapter) return;
    try {
      const answer = await request(`/ui/api/rollouts?adapter=${encodeURIComponent(adapter)}`);
      setText(this.listError, "");
      this.showList(adapter, answer.rollouts ?? []);
      const newest = this.rollouts.at(-1);
      const wanted = this.rollouts.find((r) => r.rollout_id === this.picked) ?? newest;
      if (wanted && this.shown !== `${adapter}/${wanted.rollout_id}`) await this.open(adapter, wanted.rollout_id);
      if (!wanted) {
        this.shown = null;
        this.doc.replaceChildren(el("p", { class: "note", text: `No rollouts of ${adapter} dumped yet.` }));
      }
    } catch (error) {
      if (!(error instanceof ApiError)) throw error;
      setText(this.listError, error.message);
    }
  }

  syncAdapters(names) {
    if (names.join("\n") === this.adapterNames.join("\n")) return;
    this.adapterNames = names;
    const chosen = this.select.value;
    this.select.replaceChildren(...names.map((name) => el("option", { value: name, text: name })));
    if (names.includes(chosen)) this.select.value = chosen;
  }

  showList(adapter, rollouts) {
    this.rollouts = rollouts;
    const key = `${adapter}:${rollouts.map((r) => r.rollout_id).join(",")}:${this.picked}:${this.shown}`;
    if (key === this.listKey) return;
    this.listKey = key;
    const newestFirst = [...rollouts].reverse();
    this.list.replaceChildren(...newestFirst.map((r) => {
      const item = el("button", { type: "button", class: "rollout-item", "data-rollout-id": r.rollout_id },
        el("b", { text: `rollout ${r.rollout_id}` }),
        el("span", { text: `step ${formatNumber(r.step)} · ${formatNumber(r.groups)} groups · ${formatTime(r.time)}` }));
      if (this.shown === `${adapter}/${r.rollout_id}`) item.setAttribute("aria-current", "true");
      item.addEventListener("click", () => {
        // Picking the newest means "follow the newest"; an older one stays on screen.
        this.picked = r === rollouts.at(-1) ? null : r.rollout_id;
        this.refresh();
      });
      return item;
    }));
    if (!rollouts.length) this.list.append(el("p", { class: "note", text: "None dumped yet." }));
  }

  async open(adapter, rolloutId) {
    const doc = await request(`/ui/api/rollouts/${encodeURIComponent(adapter)}/${encodeURIComponent(rolloutId)}`);
    if (this.select.value !== adapter) return; // the user moved on meanwhile
    this.shown = `${adapter}/${rolloutId}`;
    this.listKey = "";
    this.showList(adapter, this.rollouts);
    const groups = doc.groups ?? [];
    this.doc.replaceChildren(
      el("div", { class: "rollout-head" },
        el("h2", { text: `${doc.adapter} · rollout ${doc.rollout_id}` }),
        el("span", { text: `step ${formatNumber(doc.step)} · ${groups.length} groups · ${formatTime(doc.time)}` }),
        doc.registration_id ? el("span", { class: "muted", text: `registration ${doc.registration_id}` }) : null),
      SHADING_KEY,
      ...groups.map(groupView));
  }
}
