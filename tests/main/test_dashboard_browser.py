"""The dashboard in a real browser: headless Chromium (Debian's package, driven by Playwright)
on the `/ui` of a running tiny trainer.

It logs in with the API token, sees each adapter's row update while it trains (a Tinker
client's model too), registers one from the YAML box (and one more that waits in the queue
until a slot frees), opens a curve, the loop and a rollout whose prompt is hostile HTML
(shown as text, never run), retires an adapter and sees it complete; the page calls no host
but the control plane and logs no error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import tinker
from tinker import types

from miles.controller.client import ControlPlaneClient
from miles.utils.types import AdapterKind, AdapterState
from tests.helpers.chromium import LAUNCH_ARGS, ChromiumUnavailableError, ensure_chromium
from tests.helpers.driver_harness import DriverProcess, cycle_datum, tiny_run_flags, write_arithmetic_dataset

TRAINER = "miles.main.train_multi_lora_async"
TOKEN = "tml-browser-test-token"  # the Tinker SDK wants its keys to start so
HOSTILE = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
TIMEOUT_MS = 120_000
TIMEOUT_S = TIMEOUT_MS / 1000
FOREVER = 100_000
"""`num_step` of the adapters that must train until they are retired (one epoch would end them)."""
REFUSED = re.compile(r"status of (401|422)")
"""The browser logs the calls the test makes fail on purpose (a wrong token, a bad body)."""


def write_hostile_dataset(path: Path, n: int) -> Path:
    """Arithmetic prompts that start with HTML a careless page would run."""
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"text": f"{HOSTILE} {10 + i}+{20 + i}=", "label": str(30 + 2 * i)}) + "\n")
    return path


@pytest.fixture(scope="module")
def chromium_path() -> str:
    try:
        return ensure_chromium()
    except ChromiumUnavailableError as error:
        pytest.skip(f"no Chromium for the browser test: {error}")


def test_the_dashboard_follows_a_running_trainer(tiny_model_dir: Path, tmp_path: Path, chromium_path: str) -> None:
    from playwright.sync_api import expect, sync_playwright

    data = tmp_path / "data"
    data.mkdir()
    add = write_arithmetic_dataset(data / "add.jsonl", 200, op="+", seed=1)
    hostile = write_hostile_dataset(data / "hostile.jsonl", 50)
    flags = tiny_run_flags(tiny_model_dir, tmp_path / "save", n_adapters=3) + [
        "--multi-lora-api-token", TOKEN, "--run-dir", str(tmp_path / "run"),
        "--dump-details", str(tmp_path / "details")]
    driver = DriverProcess(TRAINER, flags, tmp_path / "trainer.log")
    try:
        url = driver.wait_for_api_url()
        client = ControlPlaneClient(url, token=TOKEN)
        client.register("plain", config={"data": str(add), "num_step": FOREVER})
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium_path, args=LAUNCH_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(TIMEOUT_MS)
            expect.set_options(timeout=TIMEOUT_MS)
            requests: list[str] = []
            problems: list[str] = []
            page.on("request", lambda request: requests.append(request.url))
            page.on("console", lambda message: problems.append(message.text)
                    if message.type == "error" and not REFUSED.search(message.text) else None)
            page.on("pageerror", lambda error: problems.append(str(error)))
            page.on("dialog", lambda dialog: problems.append(f"dialog: {dialog.message}"))

            page.goto(f"{url}/ui")
            page.fill("#login-token", "wrong")
            page.click("#login-button")
            expect(page.locator("#login-error")).to_contain_text("token")  # the API's own words
            page.fill("#login-token", TOKEN)
            page.click("#login-button")

            # Register from the YAML box: a bad body is refused in the API's words, then a good one.
            page.click("#tab-adapters")
            page.fill("#register-yaml", "name: hostile\nconfig:\n  num_step: -1\n")
            page.click("#register-button")
            expect(page.locator("#register-result")).to_contain_text("num_step")
            page.fill("#register-yaml", f"name: hostile\nconfig:\n  data: {hostile}\n  num_step: {FOREVER}\n")
            page.click("#register-button")
            expect(page.locator("#register-result")).to_contain_text("slot")

            # Every row updates while the page stays open.
            for name in ("plain", "hostile"):
                row = page.locator(f'tr[data-adapter="{name}"]')
                expect(row.locator(".state")).to_have_text(re.compile("active", re.I))
                first = _step(row.locator(".step").inner_text())
                expect(row.locator(".step")).not_to_have_text(re.compile(rf"^{first}(/|$)"))

            # A Tinker client's model gets its row too, and steps there.
            with tinker.ServiceClient(base_url=url, api_key=TOKEN) as service:
                model = service.create_lora_training_client(str(tiny_model_dir), rank=4, seed=1,
                                                            train_unembed=False).result(timeout=TIMEOUT_S)
                name = next(s.name for s in client.list() if s.kind is AdapterKind.CLIENT)
                row = page.locator(f'tr[data-adapter="{name}"]')
                expect(row.locator(".kind")).to_have_text("client")
                model.forward_backward([cycle_datum(0)], "cross_entropy").result(timeout=TIMEOUT_S)
                model.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=TIMEOUT_S)
                expect(row.locator(".step")).to_have_text(re.compile(r"^\s*1\b"))

                # While the model holds the last slot, a registration waits in the queue, its place shown.
                page.fill("#register-yaml", f"name: waiting\nconfig:\n  data: {add}\n")
                page.click("#register-button")
                expect(page.locator("#register-result")).to_contain_text("Queued waiting at position 1")
                expect(page.locator('tr[data-adapter="waiting"] .state')).to_have_text("QUEUED #1")

            # A curve of both adapters, with a hover value.
            page.click("#tab-curves")
            page.select_option("#curve-metric", "raw_reward_mean")
            for name in ("plain", "hostile"):
                box = page.locator(f'.curve-adapter[value="{name}"]')
                if not box.is_checked():
                    box.check()
            chart = page.locator("#curve-chart svg")
            expect(chart.locator("path.series")).to_have_count(2)
            bounds = chart.bounding_box()
            assert bounds is not None
            page.mouse.move(bounds["x"] + bounds["width"] * 0.8, bounds["y"] + bounds["height"] / 2)
            expect(page.locator("#curve-tooltip")).to_contain_text("step")

            # The loop's stages and the batch's composition.
            page.click("#tab-loop")
            expect(page.locator("#loop-chart .bars rect").first).to_be_visible()
            expect(page.locator("#batch-chart .bars rect").first).to_be_visible()

            # A rollout of the hostile adapter: its prompt is text, its tokens shaded.
            page.click("#tab-rollouts")
            page.select_option("#rollout-adapter", "hostile")
            group = page.locator(".rollout-group").first
            expect(group).to_contain_text(HOSTILE)
            expect(group.locator(".sample .token").first).to_be_visible()
            assert page.evaluate("window.__pwned") is None
            assert page.locator("img[src='x']").count() == 0

            # Retire with a confirmation; the row ends COMPLETED.
            page.click("#tab-adapters")
            row = page.locator('tr[data-adapter="plain"]')
            row.locator(".retire-button").click()
            page.click("#confirm-retire")
            expect(row.locator(".state")).to_have_text(re.compile("completed", re.I))
            assert client.status("plain").state is AdapterState.COMPLETED
            # Its slot went to the queued registration.
            expect(page.locator('tr[data-adapter="waiting"] .state')).to_have_text(re.compile("PENDING|ACTIVE"))

            browser.close()
        foreign = [u for u in requests if not u.startswith(url + "/")]
        assert not foreign, f"the page called other hosts: {foreign}"
        assert not problems, problems
    finally:
        driver.kill()


def _step(text: str) -> str:
    """`3/10` or `3`: the step before the slash."""
    return text.split("/")[0].strip()
