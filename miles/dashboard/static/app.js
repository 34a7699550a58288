// The dashboard page: login, tabs, and one polling loop that feeds the visible view.
//
// Rule for every module of this page: dynamic text (adapter names, prompts, responses, tokens,
// metric names, errors) enters the DOM only through textContent, createTextNode or
// setAttribute, and SVG through createElementNS. Never innerHTML, outerHTML,
// insertAdjacentHTML, document.write or HTML built from strings. The server's CSP also forbids
// inline scripts, style attributes in markup, inline event handlers and eval.

import { AdaptersView } from "./adapters.js";
import { AuthError, request, token } from "./api.js";
import { CurvesView } from "./curves.js";
import { adapterColour, setText } from "./dom.js";
import { LoopView } from "./loop.js";
import { RolloutsView } from "./rollouts.js";
import { RecordStore } from "./store.js";

const DEFAULT_POLL_MS = 1000;
/** Adapters read per poll: every live and queued one first; finished ones past it are not shown. */
const ADAPTER_PAGE = 200;
const TABS = ["adapters", "curves", "loop", "rollouts"];

const ctx = {
  info: null, // /ui/api/info
  store: new RecordStore(),
  adapterRuns: [], // GET /adapter_runs: its first page (live, then queued, then finished adapters)
  adapterRunsTotal: 0, // every adapter the control plane holds
  adapterRunsError: null,
};

let views = null;
let active = TABS.includes(location.hash.slice(1)) ? location.hash.slice(1) : "adapters";
let timer = null;
let inFlight = false;
let again = false;
let stopped = true;
let lastUpdate = null;

// ---- login -------------------------------------------------------------------------

function showLogin(detail) {
  stopped = true;
  clearTimeout(timer);
  document.getElementById("app").hidden = true;
  document.getElementById("login").hidden = false;
  document.getElementById("logout-button").hidden = true;
  setText(document.getElementById("login-error"), detail ?? "");
  setLive("signed-out", "signed out");
  document.getElementById("login-token").focus();
}

function onAuthError(error) {
  token.clear();
  showLogin(error.message);
}

async function start() {
  try {
    ctx.info = await request("/ui/api/info");
  } catch (error) {
    if (error instanceof AuthError) return showLogin(error.message);
    setLive("error", `cannot reach the dashboard API: ${error.message}`);
    timer = setTimeout(start, 5000);
    return;
  }
  document.getElementById("login").hidden = true;
  document.getElementById("app").hidden = false;
  document.getElementById("logout-button").hidden = !token.get();
  const { mode, run_dir: runDir } = ctx.info;
  setText(document.getElementById("run-mode"), mode === "live" ? "live trainer" : "run directory");
  setText(document.getElementById("run-dir"), runDir ?? "");
  views ??= {
    adapters: new AdaptersView({ onAuthError, refresh: pollSoon }),
    curves: new CurvesView(),
    loop: new LoopView(),
    rollouts: new RolloutsView({ refresh: pollSoon }),
  };
  stopped = false;
  showTab(active);
}

document.getElementById("login-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const field = document.getElementById("login-token");
  token.set(field.value);
  field.value = "";
  start();
});

document.getElementById("logout-button").addEventListener("click", () => {
  token.clear();
  showLogin("");
});

// ---- tabs --------------------------------------------------------------------------

function showTab(name) {
  active = name;
  for (const tab of TABS) {
    document.getElementById(`tab-${tab}`).setAttribute("aria-selected", String(tab === name));
    document.getElementById(`view-${tab}`).hidden = tab !== name;
  }
  if (location.hash !== `#${name}`) history.replaceState(null, "", `#${name}`);
  pollSoon();
}

for (const tab of TABS) document.getElementById(`tab-${tab}`).addEventListener("click", () => showTab(tab));

// ---- polling -----------------------------------------------------------------------

function pollSoon() {
  if (stopped) return;
  if (inFlight) {
    again = true;
    return;
  }
  clearTimeout(timer);
  timer = setTimeout(tick, 0);
}

async function tick() {
  if (stopped || document.visibilityState === "hidden") return;
  inFlight = true;
  try {
    await ctx.store.poll(request);
    // Colours follow the order adapters appear in the records, so a reload gives the same ones.
    for (const name of ctx.store.adapters.keys()) adapterColour(name);
    // The adapter list feeds the adapters view and the rollouts' adapter choice only.
    if (active === "adapters" || active === "rollouts" || !lastUpdate) await pollAdapterRuns();
    await views[active].update(ctx);
    lastUpdate = new Date();
    setLive("live", `live · updated ${lastUpdate.toLocaleTimeString()}`);
  } catch (error) {
    if (error instanceof AuthError) return onAuthError(error);
    const since = lastUpdate ? ` · last update ${lastUpdate.toLocaleTimeString()}` : "";
    setLive("error", `${error.message}${since}`);
  } finally {
    inFlight = false;
  }
  const delay = again ? 0 : ctx.info.poll_ms ?? DEFAULT_POLL_MS;
  again = false;
  if (!stopped) timer = setTimeout(tick, delay);
}

async function pollAdapterRuns() {
  try {
    const page = await request(`/adapter_runs?limit=${ADAPTER_PAGE}`);
    ctx.adapterRuns = page.adapters ?? [];
    ctx.adapterRunsTotal = page.total ?? ctx.adapterRuns.length;
    ctx.adapterRunsError = null;
  } catch (error) {
    if (error instanceof AuthError) throw error;
    ctx.adapterRunsError = error.message;
  }
}

function setLive(state, text) {
  const live = document.getElementById("live");
  live.dataset.state = state;
  setText(document.getElementById("live-text"), text);
}

document.addEventListener("visibilitychange", () => {
  if (document.visibilityState === "hidden") {
    clearTimeout(timer);
    if (!stopped) setLive("paused", "paused while the tab is hidden");
  } else {
    pollSoon();
  }
});

let resizeTimer = null;
window.addEventListener("resize", () => {
  clearTimeout(resizeTimer);
  resizeTimer = setTimeout(() => views?.[active].resize?.(), 150);
});

start();
