"""End-to-end: Tinker SDK clients against the trainer as users run it.

`python -m miles.main.train_multi_lora_async` runs as a subprocess; the official SDK
(`tinker`) drives client-driven models on the trainer's own slots. On a tiny random model:
two SFT clients, each alone, then both at once beside a server-driven RL adapter registered
over the control plane (each equal to its run alone), each client step shown in the run's
metrics records and the control plane's `/metrics`. On the tiny pretrained base: an SDK RL
loop that raises the held-out reward of additions while sampling, from the engines, exactly
the snapshots it trains, its model paged out of its slot and back in whenever it idles.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import tinker
from tinker import types
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from miles.controller.client import ControlPlaneClient
from miles.lora import read_peft_dir
from miles.recipes.tasks import Example, answer_is_correct, read_examples
from miles.utils.tracking import read_metrics
from miles.utils.types import AdapterKind, AdapterState
from tests.helpers.driver_harness import DriverProcess, cycle_datum, tiny_run_flags, write_arithmetic_dataset

pytestmark = pytest.mark.slow

TRAINER = "miles.main.train_multi_lora_async"
API_KEY = "tml-local"
TIMEOUT = 240.0
LR = 2e-2


@pytest.fixture(autouse=True)
def no_sdk_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_TELEMETRY", "0")


@dataclass
class ClientRun:
    model_id: str
    losses: list[float]
    """`loss:sum` of each forward_backward."""
    held_out_before: float
    held_out_after: float
    logprobs_after: list[float]


def held_out_loss(trainer: tinker.TrainingClient, datum: types.Datum) -> tuple[float, list[float]]:
    out = trainer.forward([datum], "cross_entropy").result(timeout=TIMEOUT)
    logprobs = out.loss_fn_outputs[0]["logprobs"].tolist()
    return -sum(logprobs), logprobs


@dataclass(frozen=True)
class SftSpec:
    """A client's model seed and data: its two training datums and its held-out one (offsets
    into the cycle of `cycle_datum`, and their lengths)."""

    seed: int
    train: tuple[tuple[int, int], ...]
    held_out: int


CLIENT_A = SftSpec(seed=11, train=((0, 12), (2, 12)), held_out=1)
CLIENT_B = SftSpec(seed=12, train=((1, 9), (0, 5)), held_out=2)


def sft_run(service: tinker.ServiceClient, base_model: str, steps: int, spec: SftSpec = CLIENT_A) -> ClientRun:
    trainer = service.create_lora_training_client(base_model, rank=4, seed=spec.seed, train_unembed=False).result(
        timeout=TIMEOUT)
    held_out = cycle_datum(spec.held_out)
    before, _ = held_out_loss(trainer, held_out)
    losses = []
    for _ in range(steps):
        # Both calls are sent before either result is read: they queue in seq_id order.
        fwd_bwd = trainer.forward_backward([cycle_datum(o, n) for o, n in spec.train], "cross_entropy")
        step = trainer.optim_step(types.AdamParams(learning_rate=LR))
        losses.append(fwd_bwd.result(timeout=TIMEOUT).metrics["loss:sum"])
        step.result(timeout=TIMEOUT)
    after, logprobs = held_out_loss(trainer, held_out)
    return ClientRun(trainer.model_id, losses, before, after, logprobs)


def test_sdk_clients_train_alone_and_beside_a_server_driven_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_arithmetic_dataset(tmp_path / "add.jsonl", 200, op="+", seed=1)
    driver = DriverProcess(TRAINER, tiny_run_flags(tiny_model_dir, tmp_path / "save", n_adapters=5),
                           tmp_path / "trainer.log")
    try:
        url = driver.wait_for_api_url()
        control = ControlPlaneClient(url)
        with tinker.ServiceClient(base_url=url, api_key=API_KEY) as service:
            # Each client alone: no RL adapter, so no generate phase; the SFT loop lowers held-out loss.
            alone = [sft_run(service, str(tiny_model_dir), steps=4, spec=spec) for spec in (CLIENT_A, CLIENT_B)]
            for run in alone:
                assert run.held_out_after < 0.95 * run.held_out_before, run
                assert run.losses[-1] < run.losses[0], run.losses

            # Both clients at once while a server-driven adapter trains: their datums go into
            # the loop's train calls beside its RL batch.
            control.register("rl", config={"data": str(data), "num_step": 10_000})
            driver.wait_until(lambda: control.status("rl").step >= 1, TIMEOUT, "the RL adapter's first step")
            with ThreadPoolExecutor(max_workers=2) as pool:
                mixed = list(pool.map(lambda spec: sft_run(service, str(tiny_model_dir), steps=4, spec=spec),
                                      (CLIENT_A, CLIENT_B)))
            rl = control.status("rl")
            assert rl.state is AdapterState.ACTIVE and rl.step >= 2, rl

            # The same model, seed and data give the same numbers, whatever shares the calls.
            for run, ref in zip(mixed, alone, strict=True):
                assert run.losses == pytest.approx(ref.losses, abs=1e-4)
                assert run.logprobs_after == pytest.approx(ref.logprobs_after, abs=1e-4)
            assert alone[0].losses != pytest.approx(alone[1].losses, abs=1e-2)  # two different clients

            runs = [*alone, *mixed]
            listed = {status.name: status for status in control.list()}
            clients = [s for s in listed.values() if s.kind is AdapterKind.CLIENT]
            assert sorted(s.model_id for s in clients) == sorted(run.model_id for run in runs)
            assert all(s.state is AdapterState.ACTIVE and s.step == 4 for s in clients), clients

            # One metrics record per optim_step, beside the RL adapter's, with the loss the SDK got.
            names = {s.model_id: s.name for s in clients}
            metrics_path = tmp_path / "save" / "metrics.jsonl"

            def client_records() -> dict[str, list[dict]]:
                records = [r for r in read_metrics(metrics_path) if r["kind"] == "adapter"]
                by_model = {name: [r for r in records if r["adapter"] == name] for name in names.values()}
                return by_model if all(len(rs) == 4 for rs in by_model.values()) else {}

            records = driver.wait_until(client_records, TIMEOUT, "a metrics record per client step")
            assert {r["adapter_kind"] for r in read_metrics(metrics_path)
                    if r["kind"] == "adapter" and r["adapter"] == "rl"} == {"server"}
            for run in runs:
                steps = records[names[run.model_id]]
                assert [(r["adapter_kind"], r["step"]) for r in steps] == [("client", n) for n in (1, 2, 3, 4)]
                assert [r["metrics"]["loss:sum"] for r in steps] == pytest.approx(run.losses, rel=1e-5)
                assert all(r["metrics"]["train_datums"] == 2 and r["metrics"]["lr"] == pytest.approx(LR)
                           for r in steps), steps

            # /metrics names each adapter's kind, and serves a client's step and its latest step's loss.
            def scrape() -> dict[str, dict[str, float]]:
                text = control.metrics()
                series: dict[str, dict[str, float]] = {}
                for metric, labels, value in re.findall(r"^(miles_adapter_\w+)\{(.*)\} (\S+)$", text, flags=re.M):
                    series.setdefault(metric, {})[labels] = float(value)
                losses = series.get("miles_adapter_client_loss", {})
                return series if all(f'adapter="{name}"' in losses for name in names.values()) else {}

            scraped = driver.wait_until(scrape, TIMEOUT, "the client models' loss on /metrics")
            assert scraped["miles_adapter_info"]['adapter="rl",kind="server"'] == 1
            for run in runs:
                label = f'adapter="{names[run.model_id]}"'
                assert scraped["miles_adapter_info"][f'{label},kind="client"'] == 1
                assert scraped["miles_adapter_step"][label] == 4
                assert scraped["miles_adapter_client_loss"][label] == pytest.approx(run.losses[-1], rel=1e-5)
                assert scraped["miles_adapter_client_commands_pending"][label] == 0
        # The session closed with the service client: its models are unloaded and their slots freed.
        driver.wait_until(lambda: all(s.state is AdapterState.COMPLETED for s in control.list()
                                      if s.kind is AdapterKind.CLIENT), TIMEOUT, "the client models to be cleaned up")
        assert control.status("rl").state is AdapterState.ACTIVE
        assert driver.terminate() == 0
    finally:
        driver.kill()


RL_TASK = "add"
RL_PROMPTS, RL_GROUP, RL_STEPS, RL_HELD_OUT = 32, 8, 10, 100
"""Each step samples groups for the next 32 prompts of the task's train split: 16 prompts seen
every step (lr 5e-3) are learnt by heart (train reward 0.2 -> 0.75) while the held-out greedy
reward falls (0.28 -> 0.15..0.28, seeds 0-3)."""
RL_LR = 2e-3
"""At 5e-3 the held-out reward swung either way (0.28 -> 0.11 and 0.36 with 16 fresh prompts a
step, 0.36 with 32)."""
RL_SEED = 0
MAX_TOKENS = 6
"""The tiny base's answers are at most three digits and EOS."""
GREEDY = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> types.ModelInput:
    return types.ModelInput.from_ints(tokenizer(text, add_special_tokens=False)["input_ids"])


def task_reward(tokenizer: PreTrainedTokenizerBase, tokens: list[int], label: str) -> float:
    """1.0 when the answer (the sampled text up to EOS or a newline) equals the label."""
    answer = tokenizer.decode(tokens, skip_special_tokens=True).split("\n", 1)[0]
    return float(answer_is_correct(answer, label))


def greedy_reward(sampler: tinker.SamplingClient, tokenizer: PreTrainedTokenizerBase, rows: list[Example]) -> float:
    """Mean reward of the greedy answers to `rows` (all requests sent before any is read)."""
    futures = [sampler.sample(encode(tokenizer, row.text), num_samples=1, sampling_params=GREEDY) for row in rows]
    return sum(task_reward(tokenizer, future.result(timeout=TIMEOUT).sequences[0].tokens, row.label)
               for future, row in zip(futures, rows, strict=True)) / len(rows)


def rl_datums(prompt: types.ModelInput, sequences: list[types.SampledSequence],
              rewards_G: list[float]) -> list[types.Datum]:
    """One importance_sampling datum per sample: its tokens' advantage is its reward minus the
    group's mean; the prompt's positions carry none."""
    baseline = sum(rewards_G) / len(rewards_G)
    n_prompt = prompt.length - 1
    data = []
    for seq, reward in zip(sequences, rewards_G, strict=True):
        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        tokens = prompt.to_ints() + seq.tokens
        data.append(types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:],
                            "logprobs": [0.0] * n_prompt + list(seq.logprobs),
                            "advantages": [0.0] * n_prompt + [reward - baseline] * len(seq.tokens)}))
    return data


@dataclass
class RlRun:
    trainer: tinker.TrainingClient
    first: tinker.SamplingClient
    """The snapshot of the untrained model."""
    latest: tinker.SamplingClient
    held_out_before: float
    held_out_after: float
    train_rewards: list[float]
    """Mean reward of each step's samples."""
    last_sample: list[int]
    """A prompt and the answer sampled for it in the last step."""


def rl_run(service: tinker.ServiceClient, base_dir: Path, *, seed: int = RL_SEED, lr: float = RL_LR,
           steps: int = RL_STEPS, prompts: int = RL_PROMPTS, group: int = RL_GROUP,
           held_out: int = RL_HELD_OUT) -> RlRun:
    """The loop as a user writes it with the SDK: sample a group per training prompt from the
    latest snapshot, reward, centre each group, importance_sampling, optim_step, snapshot again;
    the held-out greedy reward measured on the first snapshot and on the last."""
    tokenizer = AutoTokenizer.from_pretrained(base_dir, local_files_only=True)
    rows = read_examples(base_dir / "data" / f"{RL_TASK}_train.jsonl")[:prompts * steps]
    test = read_examples(base_dir / "data" / f"{RL_TASK}_test.jsonl")[:held_out]
    trainer = service.create_lora_training_client(str(base_dir), rank=4, seed=seed).result(timeout=TIMEOUT)
    first = sampler = trainer.save_weights_and_get_sampling_client().result(timeout=TIMEOUT)
    before = greedy_reward(first, tokenizer, test)
    train_rewards: list[float] = []
    last: list[int] = []
    for step in range(steps):
        train = rows[step * prompts:(step + 1) * prompts]
        futures = [sampler.sample(encode(tokenizer, row.text), num_samples=group, sampling_params=types.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=1.0, seed=seed * 1_000_000 + (step * prompts + i) * group))
            for i, row in enumerate(train)]
        data, rewards = [], []
        for future, row in zip(futures, train, strict=True):
            sequences = future.result(timeout=TIMEOUT).sequences
            rewards_G = [task_reward(tokenizer, seq.tokens, row.label) for seq in sequences]
            prompt = encode(tokenizer, row.text)
            data += rl_datums(prompt, sequences, rewards_G)
            rewards += rewards_G
            last = prompt.to_ints() + sequences[0].tokens
        train_rewards.append(sum(rewards) / len(rewards))
        fwd_bwd = trainer.forward_backward(data, "importance_sampling")
        optim = trainer.optim_step(types.AdamParams(learning_rate=lr))
        fwd_bwd.result(timeout=TIMEOUT)
        optim.result(timeout=TIMEOUT)
        sampler = trainer.save_weights_and_get_sampling_client().result(timeout=TIMEOUT)
    after = greedy_reward(sampler, tokenizer, test)
    return RlRun(trainer, first, sampler, before, after, train_rewards, last)


def test_an_sdk_rl_loop_raises_the_reward_and_samples_the_snapshots_it_trains(tiny_base_dir: Path,
                                                                              tmp_path: Path) -> None:
    """sample -> reward -> importance_sampling -> optim_step -> save_weights_for_sampler -> sample,
    every call through the SDK against the trainer on the tiny pretrained base: the held-out
    greedy reward rises, each round samples the snapshot the round before wrote, and the engines
    serve exactly the trainer's weights. The trainer runs with `--lora-unembed` and the model
    takes the SDK's default layout (`train_unembed=True`, as the cookbook's recipes create
    theirs): its lm_head LoRA trains, is snapshotted and served. The model is paged out of its
    slot whenever it idles half a second (while the client samples) and paged back in by its
    next call: the numbers are those of a model that never left (paging is exact)."""
    flags = [*tiny_run_flags(tiny_base_dir, tmp_path / "save", n_adapters=2), "--lora-unembed",
             "--multi-lora-idle-evict-s", "0.5"]
    driver = DriverProcess(TRAINER, flags, tmp_path / "trainer.log")
    try:
        url = driver.wait_for_api_url()
        with tinker.ServiceClient(base_url=url, api_key=API_KEY) as service:
            run = rl_run(service, tiny_base_dir)
            # Measured (held-out greedy reward on 100 test additions, before -> after 10 steps):
            # Measured, held-out greedy reward on the first 100 test additions: 0.28 before; after 10
            # steps with seeds 0-5, 0.47, 0.42, 0.47, 0.44, 0.46, 0.44 (the loop: 19 s on 2 cores).
            assert run.held_out_after >= run.held_out_before + 0.1, run
            assert sum(run.train_rewards[-3:]) > sum(run.train_rewards[:3]), run.train_rewards

            # The latest snapshot scores a sequence as the trainer's slot does, and not as the first one did.
            tokens = run.last_sample
            sequence = types.ModelInput.from_ints(tokens)
            served = run.latest.compute_logprobs(sequence).result(timeout=TIMEOUT)[1:]
            before = run.first.compute_logprobs(sequence).result(timeout=TIMEOUT)[1:]
            ours = run.trainer.forward([types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                                    loss_fn_inputs={"target_tokens": tokens[1:]})],
                                       "cross_entropy").result(timeout=TIMEOUT).loss_fn_outputs[0]["logprobs"].tolist()
            assert served == pytest.approx(ours, abs=1e-4)
            moved = max(abs(a - b) for a, b in zip(served, before, strict=True))
            assert moved > 1e-2, f"{RL_STEPS} steps moved the served logprobs by only {moved:.1e}"
            # The snapshot holds the head's LoRA, trained (B moved off zero).
            snapshot = next((tmp_path / "save").rglob("sampler_weights"))
            tensors, config = read_peft_dir(max(snapshot.iterdir(), key=lambda p: p.stat().st_mtime))
            assert "lm_head" in config["target_modules"]
            assert tensors["base_model.model.lm_head.lora_B.weight"].abs().max() > 1e-3
            log = driver.log_path.read_text()
            paged = "Paged out client models idle for 0.5 s or more" in log and " paged in from " in log
            assert paged, driver.log_tail()
    finally:
        driver.kill()
