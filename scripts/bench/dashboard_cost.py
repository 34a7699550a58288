"""What the dashboard costs the loop: iteration time with the page open ÷ with it closed.

    python scripts/bench/dashboard_cost.py --model tiny                  # the demo's settings
    python scripts/bench/dashboard_cost.py --quick                       # smoke run

Starts the trainer as `trainer_service.py` does (the demo's settings in service mode, its
adapters POSTed, `--dump-details` on in both halves, as in `make demo`), then alternates
windows of `--window-iterations` loop records: the dashboard open in headless Chromium
(logged in, stepping through its four views, polling as a user's page does) and no page at
all. Each repetition is one open and one closed window, their order swapped every other
repetition so a drift of the machine's load falls on both; the figure is the median
`perf/iteration_time` of the open window ÷ that of the closed one (target <= 1.02). The
browser runs on the same two cores as the trainer here, so its own rendering is counted
against the loop; on a user's laptop it would not be.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import ROOT, Figure, base_parser, report  # noqa: E402
from trainer_service import TOKEN, CheckFailed, Trainer, demo_adapters, trainer_config  # noqa: E402

sys.path.insert(0, str(ROOT / "tests" / "main"))
from chromium import LAUNCH_ARGS, ensure_chromium  # noqa: E402

VIEWS = ("#tab-adapters", "#tab-curves", "#tab-loop", "#tab-rollouts")
VIEW_S = 2.0
"""Seconds on each view before the next (the page polls throughout)."""


def loop_times_after(trainer: Trainer, after: int, need: int, timeout: float,
                     while_waiting: Any = None) -> tuple[list[float], int]:
    """`perf/iteration_time` of the `need` loop records after the first `after`; calls
    `while_waiting()` between polls (the page's clicks)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        trainer.alive()
        records = trainer.loop_records()
        if len(records) >= after + need:
            window = records[after:after + need]
            return [r["metrics"]["perf/iteration_time"] for r in window], after + need
        if while_waiting is not None:
            while_waiting()
        else:
            time.sleep(0.2)
    raise CheckFailed(f"timed out after {timeout:.0f}s waiting for {need} loop records:\n{trainer.log_tail()}")


class OpenPage:
    """The dashboard in a browser tab, logged in, moved to the next view every `VIEW_S`."""

    def __init__(self, browser: Any, url: str) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.page.goto(f"{url}/ui")
        self.page.fill("#login-token", TOKEN)
        self.page.click("#login-button")
        self.page.wait_for_selector('tr[data-adapter]')
        self.view = 0
        self.requests = 0
        self.page.on("request", self._count)
        self.since = time.monotonic()

    def _count(self, _request: Any) -> None:
        self.requests += 1

    def step(self) -> None:
        """Lets the page run for a view's time, then opens the next view."""
        self.page.wait_for_timeout(VIEW_S * 1000)
        self.view = (self.view + 1) % len(VIEWS)
        self.page.click(VIEWS[self.view])

    def close(self) -> float:
        """Closes the tab; returns the page's requests per second while it was open."""
        rate = self.requests / max(time.monotonic() - self.since, 1e-9)
        self.page.close()
        return rate


def main() -> int:
    parser = base_parser(__doc__, default_reps=4)
    parser.add_argument("--window-iterations", type=int, default=6, help="loop records per window")
    parser.add_argument("--warmup", type=int, default=3, help="loop records skipped at the start")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds any one wait may take")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.window_iterations, args.warmup = 1, 2, 1
    from playwright.sync_api import sync_playwright

    workdir = Path(tempfile.mkdtemp(prefix="dashboard_cost_"))
    adapters = demo_adapters(args.model, args.quick)
    config = trainer_config(args.model, workdir, len(adapters), args.quick)
    settings = yaml.safe_load(config.read_text())
    settings["dump_details"] = str(workdir / "details")
    config.write_text(yaml.safe_dump(settings))
    trainer = Trainer(config, workdir)
    open_times: list[float] = []
    closed_times: list[float] = []
    rates: list[float] = []
    try:
        trainer.connect(args.timeout)
        for name, adapter in adapters:
            trainer.register(name, adapter).raise_for_status()
        seen = args.warmup
        loop_times_after(trainer, 0, seen, args.timeout)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=ensure_chromium(), args=LAUNCH_ARGS)
            for rep in range(args.reps):
                order = ("open", "closed") if rep % 2 == 0 else ("closed", "open")
                for side in order:
                    if side == "open":
                        page = OpenPage(browser, trainer.url)
                        times, seen = loop_times_after(trainer, seen + 1, args.window_iterations, args.timeout,
                                                       page.step)
                        rates.append(page.close())
                        open_times.append(statistics.median(times))
                    else:
                        times, seen = loop_times_after(trainer, seen + 1, args.window_iterations, args.timeout)
                        closed_times.append(statistics.median(times))
                    # `seen + 1`: the record written while the page opened or closed counts for neither side.
            browser.close()
    finally:
        code = trainer.stop()
    if code != 0:
        print(f"the trainer exited with {code}:\n{trainer.log_tail()}", file=sys.stderr)
        return 1
    figures = [Figure("loop iteration with the dashboard open in headless Chromium (same 2 cores) ÷ no page",
                      args.model, "page open", "no page", open_times, closed_times, "s", "ours/baseline", "<= 1.02",
                      params={"page_requests_per_s": statistics.median(rates) if rates else None,
                              "window_iterations": args.window_iterations, "dump_details": True})]
    report(figures, args.json, sys.argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
