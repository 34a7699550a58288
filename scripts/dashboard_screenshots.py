"""Screenshots of each dashboard view from a `make demo` run, for the README.

    python scripts/dashboard_screenshots.py                  # docs/images/dashboard_*.png
    python scripts/dashboard_screenshots.py --steps 30 --out /tmp/shots

Starts the demo (`configs/tiny-multi-lora.yaml`: its three adapters, `--dump-details`), with
the control plane on a free port and a token, waits until every adapter has taken
`--steps` steps, then opens `/ui` in headless Chromium (the browser of the browser test),
logs in and saves one PNG per view: adapters, curves (every adapter's reward), the loop,
and the newest rollout of the first adapter. The trainer is stopped afterwards (SIGTERM:
its adapters are saved).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT))
from trainer_service import TOKEN, Trainer  # noqa: E402

from tests.helpers.chromium import LAUNCH_ARGS, ensure_chromium  # noqa: E402

DEMO = ROOT / "configs" / "tiny-multi-lora.yaml"
VIEWPORT = {"width": 1360, "height": 860}


def demo_config(workdir: Path) -> Path:
    cfg = yaml.safe_load(DEMO.read_text())
    cfg.update(multi_lora_api_port=0, multi_lora_api_token=TOKEN, save=str(workdir / "save"),
               dump_details=str(workdir / "details"), hf_checkpoint=str(ROOT / cfg["hf_checkpoint"]),
               multi_lora_adapters=[str(ROOT / p) for p in cfg["multi_lora_adapters"]])
    path = workdir / "demo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--steps", type=int, default=20, help="steps every adapter takes before the screenshots")
    parser.add_argument("--timeout", type=float, default=1200.0)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="dashboard_shots_"))
    trainer = Trainer(demo_config(workdir), workdir)
    try:
        trainer.connect(args.timeout)
        trainer.wait_until(f"every adapter at step {args.steps}",
                           lambda: (a := trainer.adapters()) and all(s["step"] >= args.steps for s in a), args.timeout,
                           poll_s=1.0)
        first = trainer.adapters()[0]["name"]
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=ensure_chromium(), args=LAUNCH_ARGS)
            page = browser.new_page(viewport=VIEWPORT, device_scale_factor=1)
            page.goto(f"{trainer.url}/ui")
            page.fill("#login-token", TOKEN)
            page.click("#login-button")
            page.wait_for_selector("tr[data-adapter] svg")
            shots = {}
            page.click("#tab-adapters")
            shots["adapters"] = page.screenshot(full_page=True)
            page.click("#tab-curves")
            page.select_option("#curve-metric", "raw_reward_mean")
            for box in page.locator(".curve-adapter").all():
                if not box.is_checked():
                    box.check()
            page.wait_for_selector("#curve-chart svg path.series")
            box = page.locator("#curve-chart svg").bounding_box()
            if box is not None:  # a hover value in the picture
                page.mouse.move(box["x"] + box["width"] * 0.7, box["y"] + box["height"] * 0.4)
            shots["curves"] = page.screenshot(full_page=True)
            page.click("#tab-loop")
            page.wait_for_selector("#loop-chart svg rect")
            shots["loop"] = page.screenshot(full_page=True)
            page.click("#tab-rollouts")
            page.select_option("#rollout-adapter", first)
            page.wait_for_selector(".rollout-group .token")
            shots["rollouts"] = page.screenshot(full_page=False)
            browser.close()
        for view, png in shots.items():
            path = args.out / f"dashboard_{view}.png"
            path.write_bytes(png)
            print(f"{view}: {path} ({len(png) // 1024} KiB)")
    finally:
        started = time.monotonic()
        code = trainer.stop()
        print(f"trainer stopped with {code} in {time.monotonic() - started:.1f}s; work directory {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
