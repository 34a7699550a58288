"""`--dump-details`: the files a trained batch becomes, their advantages against the train
group's, pruning, atomic writes, and a loop that never waits for a slow writer."""

from __future__ import annotations

import json
import logging
import os
import random
import threading
from pathlib import Path

import pytest

from miles.backends.base import AdapterStepStats, AdapterTrainStats, TrainResult
from miles.backends.common.loss import batch_advantages
from miles.main import rollout_dump
from miles.main.progress import RunProgress
from miles.main.rollout_dump import DumpJob, RolloutDump, RolloutFiles, sample_advantages
from miles.main.train_step import TrainedBatch
from miles.recipes.tiny_model import build_char_tokenizer
from miles.utils.adapter_config import AdapterDefaults, AdapterRunConfig, resolve_adapter_config
from miles.utils.arguments import parse_args
from miles.utils.loss_settings import LossSettings
from miles.utils.tracking import MetricsLogger, read_metrics
from miles.utils.types import (
    AdapterRolloutStats,
    AdapterRun,
    MultiLoRASnapshot,
    RolloutBatch,
    Sample,
    SampleStatus,
)

TOKENIZER = build_char_tokenizer()
DEADLINE_S = 30.0

B_LOSS = {"advantage_estimator": "reinforce_plus_plus", "normalize_advantages": True, "gamma": 0.5}
"""Adapter b's `loss:` keys: a per-token estimator."""


def adapter_run(name: str, slot: int, step: int, config: AdapterRunConfig) -> AdapterRun:
    return AdapterRun(name=name, config=config, slot=slot, version=step, step=step, accumulated_groups=0,
                      registration_id=f"reg-{name}")


def resolved(tmp_path: Path, name: str, loss: dict | None = None) -> AdapterRunConfig:
    data = tmp_path / f"{name}.jsonl"
    data.write_text('{"text": "1+1="}\n')
    raw: dict = {"data": str(data), "n_samples_per_prompt": 2, "rm_type": "math",
                 "save": str(tmp_path / "save" / name)}
    if loss is not None:
        raw["loss"] = loss
    return resolve_adapter_config(name, raw, AdapterDefaults())


def sample(adapter: str, slot: int, group: int, index: int, response: str, reward: float, **kw) -> Sample:
    prompt = f"q{group}?"
    return Sample(adapter=adapter, slot=slot, group_index=group, index=index, prompt=prompt, label=f"l{group}",
                  metadata={}, prompt_ids=TOKENIZER.encode(prompt), response_ids=TOKENIZER.encode(response),
                  response=response, reward=reward, **kw)


def two_adapter_batch(rollout_id: int = 7) -> RolloutBatch:
    """a (slot 0, grpo): a multi-turn sample whose tool output is masked out, with engine
    logprobs, and a truncated one; b (slot 1, reinforce++): a sample whose first tokens are
    masked out."""
    groups = [
        [sample("a", 0, 12, 0, "ab\ncd", 1.0, loss_mask=[1, 1, 0, 0, 1],
                rollout_logprobs=[-0.5, -1.0, -0.25, -2.0, -0.125]),
         sample("a", 0, 12, 1, "x y", 0.0, status=SampleStatus.TRUNCATED)],
        [sample("b", 1, 3, 0, "zz", 1.0, loss_mask=[0, 1]),
         sample("b", 1, 3, 1, "w", 0.5)],
    ]
    return RolloutBatch(rollout_id=rollout_id, samples=[s for g in groups for s in g], prompt_group_sizes=[2, 2],
                        groups_per_adapter={"a": 1, "b": 1}, step_names=["a"], group_versions=[4, 2])


def dump_to(root: Path, *, keep: int = 8, **kw) -> RolloutDump:
    return RolloutDump(RolloutFiles(root, keep, lambda: TOKENIZER), default_loss=LossSettings(), **kw)


def test_a_batch_of_two_adapters_gives_each_its_document(tmp_path):
    snapshot = MultiLoRASnapshot(active={"a": adapter_run("a", 0, 3, resolved(tmp_path, "a")),
                                         "b": adapter_run("b", 1, 1, resolved(tmp_path, "b", B_LOSS))})
    dump = dump_to(tmp_path / "rollouts", clock=lambda: 1733.5)
    dump.submit(two_adapter_batch(), snapshot)
    dump.close()
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("rollout_*")) == [
        "rollouts/a/rollout_00000007.json", "rollouts/b/rollout_00000007.json"]

    a = json.loads((tmp_path / "rollouts/a/rollout_00000007.json").read_text())
    root = 0.5 / (0.5 ** 0.5 + 1e-6)  # rewards 1 and 0: centred (+-0.5), over their std (sqrt 0.5)
    assert a == {
        "adapter": "a", "rollout_id": 7, "step": 3, "registration_id": "reg-a", "time": 1733.5,
        "groups": [{"group_index": 12, "version": 4, "prompt": "q12?", "label": "l12", "samples": [
            {"index": 0, "response": "ab\ncd", "reward": 1.0, "advantage": pytest.approx(root, abs=1e-6),
             "status": "completed", "truncated": False, "aborted": False,
             "tokens": ["a", "b", "\n", "c", "d"], "logprobs": [-0.5, -1.0, -0.25, -2.0, -0.125],
             "loss_mask": [1, 1, 0, 0, 1]},
            {"index": 1, "response": "x y", "reward": 0.0, "advantage": pytest.approx(-root, abs=1e-6),
             "status": "truncated", "truncated": True, "aborted": False,
             "tokens": ["x", " ", "y"],  # decoded: a space, not the byte-level "Ġ"
             "logprobs": None, "loss_mask": None},
        ]}],
    }
    b = json.loads((tmp_path / "rollouts/b/rollout_00000007.json").read_text())
    assert (b["adapter"], b["step"], b["registration_id"], b["groups"][0]["version"]) == ("b", 1, "reg-b", 2)
    assert [s["tokens"] for s in b["groups"][0]["samples"]] == [["z", "z"], ["w"]]
    assert [s["loss_mask"] for s in b["groups"][0]["samples"]] == [[0, 1], None]
    # b's own settings (reinforce++), read at its first trained token: the masked-out first
    # token of sample 0 is skipped.
    settings = LossSettings(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, gamma=0.5)
    per_token = batch_advantages(two_adapter_batch().samples[2:], [2], {"b": settings})
    assert [s["advantage"] for s in b["groups"][0]["samples"]] == [
        pytest.approx(per_token[0][1], abs=1e-6), pytest.approx(per_token[1][0], abs=1e-6)]  # type: ignore[index]
    assert per_token[0][1] != per_token[0][0]  # type: ignore[index]


def _mixed_batch(seed: int) -> tuple[RolloutBatch, dict[str, LossSettings]]:
    """Groups of four adapters with different estimators, loss masks and group sizes, in slot order."""
    rng = random.Random(seed)
    settings = {
        "grpo": LossSettings(normalize_advantages=True),
        "drgrpo": LossSettings(grpo_std_normalization=False),
        "rpp": LossSettings(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, gamma=0.9),
        "rppb": LossSettings(advantage_estimator="reinforce_plus_plus_baseline", normalize_advantages=True),
    }
    groups = []
    for slot, name in enumerate(settings):
        for g in range(2):
            group = []
            for i in range(rng.choice([2, 3])):
                n = rng.randint(2, 6)
                mask = [rng.choice([0, 1, 1]) for _ in range(n)] if rng.random() < 0.5 else None
                if mask is not None and not any(mask):
                    mask[-1] = 1
                response = [rng.randrange(4, 60) for _ in range(n)]
                group.append(Sample(adapter=name, slot=slot, group_index=g, index=i, prompt="p", label=None,
                                    metadata={}, prompt_ids=[5, 6], response_ids=response,
                                    reward=float(rng.randint(0, 2)) + rng.random(), loss_mask=mask))
            groups.append(group)
    batch = RolloutBatch(rollout_id=0, samples=[s for g in groups for s in g],
                         prompt_group_sizes=[len(g) for g in groups], groups_per_adapter={name: 2 for name in settings},
                         step_names=[])
    return batch, settings


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_advantages_are_the_ones_the_train_group_computes_for_the_batch(seed):
    """The train group computes every adapter's advantages over the whole mixed batch
    (`TrainGroup._advantages` is `batch_advantages` with each adapter's settings); the dump,
    one adapter at a time, gets the same: the sample's value, or a per-token estimator's at
    its first trained token."""
    batch, settings = _mixed_batch(seed)
    expected = batch_advantages(batch.samples, batch.prompt_group_sizes, settings)
    groups = rollout_dump.adapter_groups(batch)
    for name, adapter_settings in settings.items():
        samples = [s for group in groups[name] for s in group.samples]
        got = sample_advantages(samples, [len(group.samples) for group in groups[name]], adapter_settings)
        rows = [i for i, s in enumerate(batch.samples) if s.adapter == name]
        for row, value in zip(rows, got):
            want = expected[row]
            if isinstance(want, list):
                mask = batch.samples[row].loss_mask or [1] * len(want)
                want = want[mask.index(1)]
            assert value == pytest.approx(want, abs=1e-6), (name, row)


def test_sentencepiece_tokens_keep_the_space_their_marker_stands_for():
    """A SentencePiece tokenizer drops the leading space of a sequence when it decodes, so a
    "▁world" decoded alone reads "world"; its text here keeps the space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "\u2581Hello": 1, "\u2581world": 2, "!": 3},
                                      unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>")
    assert tokenizer.decode([2]) == "world"  # what decoding one id alone gives
    assert rollout_dump.TokenTexts(tokenizer)([1, 2, 3]) == [" Hello", " world", "!"]


def test_kl_shaped_advantages_are_null_not_guessed():
    settings = LossSettings(advantage_estimator="reinforce_plus_plus", normalize_advantages=True, kl_coef=0.1)
    samples = two_adapter_batch().samples[2:]
    assert sample_advantages(samples, [2], settings) == [None, None]


def job(rollout_id: int, name: str = "a", time: float = 0.0) -> DumpJob:
    groups = [sample(name, 0, rollout_id, i, "ok", float(i)) for i in range(2)]
    batch = RolloutBatch(rollout_id=rollout_id, samples=groups, prompt_group_sizes=[2], groups_per_adapter={name: 1},
                         step_names=[])
    return DumpJob(batch, {name: rollout_dump.AdapterAtDump(rollout_id, "reg", LossSettings())}, time)


def test_only_the_newest_files_of_each_adapter_are_kept(tmp_path):
    """`keep` per adapter, the files written last; an earlier run's file (a higher rollout id:
    a restarted trainer counts from 0 again) goes first."""
    (tmp_path / "a").mkdir()
    earlier = tmp_path / "a" / "rollout_00000099.json"
    earlier.write_text("{}")
    os.utime(earlier, (1_000_000, 1_000_000))
    files = RolloutFiles(tmp_path, 3, lambda: TOKENIZER)
    for rollout_id in range(3):
        files.write(job(rollout_id))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [f"rollout_{i:08d}.json" for i in range(3)]
    for rollout_id in range(3, 6):
        files.write(job(rollout_id))
    files.write(job(0, "b"))
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [f"rollout_{i:08d}.json" for i in (3, 4, 5)]
    assert [p.name for p in (tmp_path / "b").iterdir()] == ["rollout_00000000.json"]


def test_a_reader_never_sees_a_partial_file(tmp_path, monkeypatch):
    """The file is whole under a name a reader ignores (a dot-file) before it is renamed into
    place; a failed rename leaves neither file behind."""
    replace = os.replace
    seen: list[list[str]] = []

    def checked_replace(src, dst):
        names = sorted(os.listdir(Path(dst).parent))
        seen.append(names)
        assert Path(src).name.startswith(".") and not Path(src).name.endswith(".json")
        for name in names:
            if name.startswith("rollout_"):
                json.loads((Path(dst).parent / name).read_text())
        json.loads(Path(src).read_text())  # the whole document is there before the rename
        replace(src, dst)

    monkeypatch.setattr(rollout_dump.os, "replace", checked_replace)
    files = RolloutFiles(tmp_path, 8, lambda: TOKENIZER)
    files.write(job(0))
    files.write(job(1))
    pid = os.getpid()
    assert seen == [[f".rollout_00000000.json.{pid}.tmp"],
                    [f".rollout_00000001.json.{pid}.tmp", "rollout_00000000.json"]]

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(rollout_dump.os, "replace", failing_replace)
    with pytest.raises(OSError):
        files.write(job(2))
    assert sorted(os.listdir(tmp_path / "a")) == ["rollout_00000000.json", "rollout_00000001.json"]


class GatedWriter:
    """Blocks in `write` until `gate` is set (a writer stuck on a slow disk)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.busy = threading.Event()
        self.written: list[int] = []

    def write(self, job: DumpJob) -> None:
        self.busy.set()
        if not self.gate.wait(DEADLINE_S):
            raise TimeoutError("the test never opened the gate")
        self.written.append(job.rollout.rollout_id)


def test_the_loop_never_waits_for_a_slow_writer(caplog):
    """While the writer is stuck, every hand-over returns: beyond `max_pending` waiting
    batches the oldest is dropped, counted, and logged once."""
    caplog.set_level(logging.WARNING, logger="miles.main.rollout_dump")
    writer = GatedWriter()
    dump = RolloutDump(writer, default_loss=LossSettings(), max_pending=2)
    empty = MultiLoRASnapshot()
    dump.submit(two_adapter_batch(0), empty)
    assert writer.busy.wait(DEADLINE_S)  # the writer holds batch 0

    def loop() -> None:
        for rollout_id in range(1, 7):
            dump.submit(two_adapter_batch(rollout_id), empty)

    looping = threading.Thread(target=loop)
    looping.start()
    looping.join(DEADLINE_S)
    assert not looping.is_alive(), "a hand-over waited for the writer"
    assert dump.dropped == 4  # 1, 2, 3 and 4 made way for 5 and 6
    writer.gate.set()
    dump.close()
    assert writer.written == [0, 5, 6]
    assert [r.getMessage() for r in caplog.records if "fell behind" in r.getMessage()] == [
        "Rollout dump fell behind: rollout 1 not dumped (the oldest waiting); further drops are counted and "
        "reported at exit"]


async def test_run_progress_hands_each_trained_batch_to_the_dump(tmp_path):
    """The hook both drivers share: `RunProgress.record` submits the batch with the snapshot
    taken after its commit (the adapter's step after the batch)."""
    metrics = MetricsLogger(tmp_path / "run")
    dump = dump_to(tmp_path / "rollouts")
    progress = RunProgress(metrics, dump=dump)
    config = resolved(tmp_path, "a")
    progress.declare(MultiLoRASnapshot(active={"a": adapter_run("a", 0, 0, config)}))
    rollout = two_adapter_batch(5)
    rollout.per_adapter = {"a": AdapterRolloutStats(groups=1, rewards=(1.0, 0.0), response_lengths=(3, 3))}
    stats = AdapterTrainStats(samples=2, loss=0.5, clip_fraction=0.0, kl=0.0, tis_weight=1.0)
    trained = TrainedBatch(TrainResult(samples=2, adapters={"a": stats}),
                           {"a": AdapterStepStats(grad_norm=1.0, lr=1e-3)})
    await progress.record(5, rollout, trained, MultiLoRASnapshot(active={"a": adapter_run("a", 0, 1, config)}), {})
    dump.close()
    metrics.close()
    document = json.loads((tmp_path / "rollouts" / "a" / "rollout_00000005.json").read_text())
    assert (document["rollout_id"], document["step"]) == (5, 1)
    assert not (tmp_path / "rollouts" / "b").exists()  # b is in no snapshot: not dumped
    (loop,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "loop"]
    assert loop["batch"] == {"a": {"groups": 1, "samples": 2}, "b": {"groups": 1, "samples": 2}}


def test_the_flags_build_the_dump_under_dir_rollouts(tmp_path, capsys):
    assert RolloutDump.from_config(parse_args([])) is None
    cfg = parse_args(["--dump-details", str(tmp_path), "--dump-details-keep", "2"])
    dump = RolloutDump.from_config(cfg)
    assert dump is not None
    try:
        assert isinstance(dump.writer, RolloutFiles)
        assert (dump.writer.root, dump.writer.keep) == (tmp_path / "rollouts", 2)
    finally:
        dump.close()
    with pytest.raises(SystemExit):
        parse_args(["--dump-details", str(tmp_path), "--dump-details-keep", "0"])
    assert "--dump-details-keep must be > 0, got 0" in capsys.readouterr().err
