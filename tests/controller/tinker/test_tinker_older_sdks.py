"""Older `tinker` SDK releases (0.24.1, 0.26.2), unmodified, over the whole training-client surface.

SkyRL 0.3 and upstream Miles' gateway target the 0.24-0.26 line. Each release is installed
once with `pip install --no-deps --target .cache/tinker-sdk/<version>` (its dependencies are
this environment's: the test checks they meet the release's declared requirements; a few
seconds per release the first time, reused after) and `tests/helpers/older_sdk_client.py` runs
in a subprocess with that directory first on PYTHONPATH against a controller on loopback (port 0).

A test-side driver plays the trainer: it scores each datum with made-up logprobs through the
trainer's own loss math (`miles.backends.common.client_loss`) and writes a PEFT adapter for
each save; a real sglang-router and builtin engine on the tiny model serve the samples
(`conftest.py`). What the SDK decoded is checked against each loss's formula, the driver's
record and the sampler's own answer for the same request.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pytest
import torch
from packaging.requirements import Requirement
from transformers import AutoTokenizer

from miles.backends.common.client_loss import ClientInputs, client_loss_terms, client_rows, datum_outputs
from miles.controller.tinker import sampler as tinker_sampler
from miles.controller.tinker.gateway import GatewayConfig
from miles.controller.tinker.models import model_name
from miles.utils.adapter_config import AdapterDefaults
from miles.utils.types import (
    AdapterState,
    ClientCommand,
    ClientCommandKind,
    ClientWork,
    ForwardBackwardResult,
    ForwardCommand,
    LoadStateCommand,
    OptimStepCommand,
    OptimStepResult,
    SamplerSnapshot,
    SamplingRequestParams,
    SaveForSamplerCommand,
    SaveStateCommand,
    WeightsResult,
)
from tests.helpers import HELPERS_DIR
from tests.helpers.controller_fakes import ThreadedController, controller_config

SDK_VERSIONS = ("0.24.1", "0.26.2")
SDK_CACHE = Path(__file__).resolve().parents[3] / ".cache" / "tinker-sdk"
CLIENT = HELPERS_DIR / "older_sdk_client.py"
TOKEN = "tml-older-sdk-test-token"
BASE = "tiny-base"
PROMPT = [3, 14, 15, 9, 26, 5]
RL_INPUTS = {"logprobs": [-0.5, -0.25, -1.0], "advantages": [1.0, -0.5, 2.0]}
"""The sampler logprobs and advantages the client sends with each RL loss (datum [8, 9, 10])."""


def unmet_requirements(sdk: Path) -> list[str]:
    """The release's declared requirements (no extras) that this environment does not meet."""
    (metadata,) = sdk.glob("tinker-*.dist-info/METADATA")
    unmet = []
    for line in metadata.read_text().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.removeprefix("Requires-Dist:").strip())
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        try:
            if requirement.specifier.contains(version(requirement.name), prereleases=True):
                continue
        except PackageNotFoundError:
            pass
        unmet.append(str(requirement))
    return unmet


def installed_sdk(release: str) -> Path:
    """`.cache/tinker-sdk/<release>`: installed from the package registry the first time, into a
    staging directory renamed into place (another test process may be installing it too)."""
    target = SDK_CACHE / release
    if not target.is_dir():
        SDK_CACHE.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{release}-", dir=SDK_CACHE))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--target", str(staging), f"tinker=={release}"], check=True, timeout=300)
        try:
            staging.rename(target)
        except OSError:  # installed meanwhile by another process: use that one
            shutil.rmtree(staging)
    unmet = unmet_requirements(target)
    assert not unmet, f"tinker {release} needs {unmet}, which this environment does not have"
    return target


def made_up_logprob(target: int) -> float:
    """The driver's logprob of a target token (no model: a function of the token)."""
    return -(target % 7 + 1) / 10


def scored(command: ClientCommand) -> ForwardBackwardResult:
    """A forward / forward_backward as the trainer's loss math scores it, from made-up logprobs."""
    request = command.request
    assert isinstance(request, ForwardCommand)
    work = ClientWork(adapter=command.model, slot=0, datums=request.datums, loss=request.loss,
                      backward=command.kind is ClientCommandKind.FORWARD_BACKWARD)
    rows = client_rows([work])
    length = max(row.length for row in rows)
    logprobs_CL = torch.zeros((len(rows), length))
    for c, row in enumerate(rows):
        logprobs_CL[c, : row.length] = torch.tensor([made_up_logprob(t) for t in row.targets])
    inputs = ClientInputs.collate(rows, length)
    return ForwardBackwardResult(outputs=datum_outputs(rows, logprobs_CL, client_loss_terms(logprobs_CL, inputs)),
                                 metrics={})


class TrainerStandIn:
    """Takes and runs client commands in a thread, as the trainer's driver does, until closed:
    forward passes scored by `scored`, saves written as the test adapter."""

    def __init__(self, plane: ThreadedController, adapter: Path) -> None:
        self.plane, self.adapter = plane, adapter
        self.ran: list[ClientCommand] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        controller = self.plane.controller
        while not self._stop.is_set():
            for command in self.plane.call(controller.take_client_commands()).commands:
                result = self._run(command)
                self.ran.append(command)  # before its future completes: the client reads `ran` once it has
                self.plane.call(controller.complete_client_command(command.future_id, result))
            self.plane.call(controller.wait_for_client_commands(0.2))

    def _run(self, command: ClientCommand) -> ForwardBackwardResult | OptimStepResult | WeightsResult:
        request = command.request
        if isinstance(request, ForwardCommand):
            return scored(command)
        if isinstance(request, OptimStepCommand):
            return OptimStepResult(metrics={"learning_rate:mean": request.adam.learning_rate})
        if isinstance(request, SaveStateCommand | SaveForSamplerCommand):
            shutil.copytree(self.adapter, request.directory)
        assert not isinstance(request, LoadStateCommand) or Path(request.directory).is_dir()
        return WeightsResult()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@pytest.fixture
def plane(data_root: Path, defaults: AdapterDefaults, router_url: str,
          tiny_model_dir: Path) -> Iterator[ThreadedController]:
    config = controller_config(data_root, defaults, n_slots=2, token=TOKEN, gateway=GatewayConfig(
        base_model=BASE, tokenizer_id=str(tiny_model_dir), retrieve_poll_s=1.0))
    controller = ThreadedController(config, router_url=router_url)
    yield controller
    controller.close()


@pytest.fixture
def trainer(plane: ThreadedController, adapter_dir: Path) -> Iterator[TrainerStandIn]:
    stand_in = TrainerStandIn(plane, adapter_dir)
    yield stand_in
    stand_in.close()


def run_client(sdk: Path, url: str) -> dict[str, Any]:
    """Run the client script with `sdk` first on its path; what it printed, by step."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TINKER_")}
    env.update(PYTHONPATH=str(sdk), TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run([sys.executable, str(CLIENT), url, TOKEN, BASE, json.dumps(PROMPT)], env=env,
                          capture_output=True, text=True, timeout=300)
    steps: dict[str, Any] = {}
    for line in done.stdout.splitlines():
        step = json.loads(line)
        steps[step.pop("step")] = step
    assert done.returncode == 0, f"the client stopped after {list(steps)}:\n{done.stderr[-4000:]}"
    return steps


def expected_loss(loss_fn: str, config: dict[str, float]) -> tuple[list[float], float]:
    """(logprobs, summed loss) of the client's datum for `loss_fn`, by the loss's formula."""
    if loss_fn == "cross_entropy":  # datum [5, 6, 7] with weights [0, 1, 1]
        lp = [made_up_logprob(t) for t in (6, 7, 0)]
        return lp, sum(-w * x for w, x in zip((0.0, 1.0, 1.0), lp))
    lp = [made_up_logprob(t) for t in (9, 10, 0)]
    q, adv = RL_INPUTS["logprobs"], RL_INPUTS["advantages"]
    lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    ratio = [math.exp(x - y) for x, y in zip(lp, q)]
    clipped = [min(max(r, lo), hi) for r in ratio]
    terms = {
        "importance_sampling": [-r * a for r, a in zip(ratio, adv)],
        "ppo": [-min(r * a, c * a) for r, c, a in zip(ratio, clipped, adv)],
        "cispo": [-c * x * a for c, x, a in zip(clipped, lp, adv)],
        "dro": [-(x * a - config.get("beta", 0.05) / 2 * (x - y) ** 2) for x, y, a in zip(lp, q, adv)],
    }[loss_fn]
    return lp, sum(terms)


LOSS_CONFIGS = {"cross_entropy": {}, "importance_sampling": {}, "cispo": {},
                "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, "dro": {"beta": 0.5}}
"""The losses the client script calls (every loss these releases list) and the config it sends."""


@pytest.mark.parametrize("release", SDK_VERSIONS)
def test_an_older_sdk_trains_saves_samples_and_lists(release: str, plane: ThreadedController,
                                                     trainer: TrainerStandIn, router_url: str,
                                                     tiny_model_dir: Path) -> None:
    sdk = installed_sdk(release)
    steps = run_client(sdk, plane.url)
    assert steps["sdk"]["version"] == release and steps["sdk"]["path"].startswith(str(sdk))
    assert steps["capabilities"]["models"] == [BASE]
    model_id = steps["model"]["model_id"]
    assert steps["model"] == {"model_id": model_id, "lora_rank": 4, "model_name": BASE,
                              "tokenizer_id": str(tiny_model_dir)}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert steps["tokenizer"]["ids"] == tokenizer.encode("one two three", add_special_tokens=False)
    status = plane.call(plane.controller.adapter_status(model_name(model_id)))
    assert (status.rank, status.seed, status.train_attn, status.train_mlp, status.train_unembed) == (
        4, 7, True, False, False)
    assert status.step == 1  # its one optim_step

    check_training(steps, trainer.ran)
    check_sampling(steps, trainer.ran, router_url)
    check_listing_and_close(steps, trainer.ran, plane)


def check_training(steps: dict[str, Any], ran: list[ClientCommand]) -> None:
    """Every loss's value is its formula's; the log ran the client's calls in order, each once."""
    by_loss = steps["forward_backward"]
    assert sorted(by_loss) == sorted(LOSS_CONFIGS)
    for loss_fn, config in LOSS_CONFIGS.items():
        logprobs, loss = expected_loss(loss_fn, config)
        (out,) = by_loss[loss_fn]["outputs"]
        assert out["logprobs"] == pytest.approx(logprobs, abs=1e-6), loss_fn
        assert math.isfinite(by_loss[loss_fn]["metrics"]["loss:sum"])
        assert by_loss[loss_fn]["metrics"]["loss:sum"] == pytest.approx(loss, abs=1e-5), loss_fn
    assert by_loss["cross_entropy"]["outputs"][0]["elementwise_loss"] == pytest.approx([0.0, 0.1, 0.1])
    sent = {c.request.loss.name: c.request.loss.config for c in ran  # type: ignore[union-attr]
            if c.kind is ClientCommandKind.FORWARD_BACKWARD}
    assert {k: sent[k] for k in LOSS_CONFIGS} == LOSS_CONFIGS
    assert steps["optim_step"]["metrics"] == pytest.approx({"learning_rate:mean": 2e-4})
    (step,) = [c.request for c in ran if isinstance(c.request, OptimStepCommand)]
    assert (step.adam.learning_rate, step.adam.beta2, step.adam.weight_decay) == pytest.approx((2e-4, 0.99, 0.01))
    assert steps["forward"]["outputs"][0]["logprobs"] == pytest.approx([made_up_logprob(2), made_up_logprob(0)])
    assert steps["forward_backward_custom"]["metrics"]["custom:sum"] == pytest.approx(
        -made_up_logprob(6) - made_up_logprob(0))

    model_id = steps["model"]["model_id"]
    own = [c for c in ran if c.model == model_name(model_id)]
    assert [c.seq_id for c in own] == list(range(1, len(own) + 1))
    K = ClientCommandKind
    assert [c.kind for c in own] == [K.FORWARD_BACKWARD] * 5 + [
        K.OPTIM_STEP, K.FORWARD,  # forward: a forward_backward with forward_only, in protobuf
        K.FORWARD, K.FORWARD_BACKWARD,  # forward_backward_custom
        K.SAVE_STATE, K.LOAD_STATE, K.LOAD_STATE, K.SAVE_WEIGHTS_FOR_SAMPLER, K.SAVE_WEIGHTS_FOR_SAMPLER]
    assert [c.request.optimizer for c in own if isinstance(c.request, LoadStateCommand)] == [False, True]
    ckpt = f"tinker://{model_id}/weights/ckpt"
    assert steps["state"] == {"saved": ckpt, "loaded": ckpt, "resumed": ckpt}

    # A training client from the checkpoint: one load_weights makes the model (the source's rank,
    # seed and layout) and loads it first; its own calls follow.
    copied = [c for c in ran if c.model == model_name(steps["from_state"]["model_id"])]
    assert [(c.seq_id, c.kind) for c in copied] == [(0, K.LOAD_STATE), (1, K.FORWARD)]
    assert copied[0].request.optimizer and copied[0].request.tinker_path == ckpt  # type: ignore[union-attr]
    assert steps["from_state"]["lora_rank"] == 4
    assert steps["from_state"]["loss"] == pytest.approx(-made_up_logprob(2) - made_up_logprob(0))


def check_sampling(steps: dict[str, Any], ran: list[ClientCommand], router_url: str) -> None:
    """Samples of the snapshot, of the save-and-sample client and of the base model: the sampler's own."""
    model_id = steps["model"]["model_id"]
    snap = next(c.request for c in ran if isinstance(c.request, SaveForSamplerCommand))
    snapshot = SamplerSnapshot(model_id=model_id, name="snap", directory=snap.directory)
    params = SamplingRequestParams(num_samples=2, max_tokens=5, seed=11, stop=[])
    want = asyncio.run(tinker_sampler.sample(router_url, snapshot, PROMPT, params))
    sample = steps["sample"]
    assert (sample["path"], sample["base_model"]) == (f"tinker://{model_id}/sampler_weights/snap", BASE)
    assert [s["tokens"] for s in sample["sequences"]] == [s.tokens for s in want.sequences]
    for got, expected in zip(sample["sequences"], want.sequences, strict=True):
        assert got["stop_reason"] == "length" and got["logprobs"] == pytest.approx(expected.logprobs, abs=1e-5)
    assert [s["tokens"] for s in steps["save_weights_and_get_sampling_client"]["sequences"]] == [
        s.tokens for s in want.sequences]  # the driver wrote the same adapter again
    base = asyncio.run(tinker_sampler.sample(router_url, None, PROMPT, params))
    assert [s["tokens"] for s in steps["sample_base"]["sequences"]] == [s.tokens for s in base.sequences]
    assert [s.tokens for s in base.sequences] != [s.tokens for s in want.sequences]  # the snapshot is not the base
    logprobs = asyncio.run(tinker_sampler.compute_logprobs(router_url, snapshot, PROMPT))
    assert sample["logprobs"][0] is None and sample["logprobs"][1:] == pytest.approx(logprobs[1:], abs=1e-5)
    assert sample["prompt_logprobs"][1:] == pytest.approx(logprobs[1:], abs=1e-5)
    assert sample["topk_prompt_logprobs"][0] is None
    assert all(len(row) == 2 for row in sample["topk_prompt_logprobs"][1:])


def check_listing_and_close(steps: dict[str, Any], ran: list[ClientCommand], plane: ThreadedController) -> None:
    """The RestClient lists both training runs and the three checkpoints; archives are refused; the
    session, whose heartbeat stopped, is finished after the timeout and its models unloaded."""
    model_id, copy_id = steps["model"]["model_id"], steps["from_state"]["model_id"]
    ckpt = f"tinker://{model_id}/weights/ckpt"
    unnamed = [c.request for c in ran if isinstance(c.request, SaveForSamplerCommand)][-1]
    assert unnamed.name.startswith("sampler-seq-")
    assert steps["rest"] == {
        "runs": [copy_id, model_id], "lora_rank": 4, "last_checkpoint": ckpt, "session": [model_id, copy_id],
        "checkpoints": sorted([ckpt, steps["sample"]["path"], unnamed.tinker_path])}
    assert "checkpoint archives are not served" in steps["archive"]["refused"]

    # These releases close a client by stopping its heartbeat (there is no finish call).
    assert steps["closed"]["session_id"] == model_id.split(":")[0]
    names = [model_name(model_id), model_name(copy_id)]

    def states() -> set[AdapterState]:
        return {plane.call(plane.controller.adapter_status(n)).state for n in names}

    assert AdapterState.RETIRING not in states()
    timeout = plane.controller.gateway.config.session_timeout_s
    plane.controller.gateway.clock = lambda: time.time() + timeout + 1
    deadline = time.monotonic() + 10
    while states() != {AdapterState.RETIRING}:  # the driver's next take of commands expires the session
        assert time.monotonic() < deadline, "the silent session was never finished"
        plane.call(plane.controller.wait_for_client_commands(0.2))
