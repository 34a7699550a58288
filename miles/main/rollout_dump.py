"""`--dump-details DIR`: the latest trained batches of each adapter as JSON, for reading.

After each trained batch the driver hands the batch over (`RolloutDump.submit`, from
`RunProgress.record`); a background thread writes, per adapter in the batch,

    DIR/rollouts/{adapter}/rollout_{rollout_id:08d}.json

and keeps the newest `--dump-details-keep` files of each adapter (by write time, so a
restarted trainer's rollout ids, which start again at 0, replace the previous run's). A
file is written to `.rollout_....json.tmp` in the same directory and renamed, so a reader
sees whole `rollout_*.json` files only. The loop never waits on JSON or the disk: the
pending batches are bounded (`MAX_PENDING`) and a writer that falls behind loses the oldest
one (counted; the first drop is logged, the total at close).

One file (`rollout_document`):

    {"adapter": "a", "rollout_id": 7, "step": 3, "registration_id": "...", "time": 1733.1,
     "groups": [{"group_index": 12, "version": 4, "prompt": "...", "label": "..." | null,
                 "samples": [{"index": 0, "response": "...", "reward": 1.0, "advantage": 0.5,
                              "status": "completed", "truncated": false, "aborted": false,
                              "tokens": ["Hel", "lo"], "logprobs": [-0.1, -2.3] | null,
                              "loss_mask": [1, 0] | null}]}]}

`step` and `registration_id` are the adapter's after the batch's commit; `time` is Unix
seconds at hand-over. `advantage` is the sequence-level advantage the trainer used
(`sample_advantages`: the same computation as the train group's, from the adapter's loss
settings); for a per-token estimator (reinforce++) the value at the sample's first trained
token; null where it needs the KL to the base model (reinforce++ with `--kl-coef`, a model
forward the dump does not run) or the sample trains on no token. `tokens` are the response
ids decoded one by one (`token_texts`), null when the tokenizer could not be loaded;
`logprobs` are the engine's (null when it gave none); `loss_mask` null means every token
trains. Non-finite numbers are written as null.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from miles.backends.common.loss import batch_advantages, needs_reward_kl
from miles.utils.adapter_config import ADAPTER_NAME_PATTERN
from miles.utils.arguments import MilesConfig
from miles.utils.loss_settings import LossSettings
from miles.utils.types import MultiLoRASnapshot, RolloutBatch, Sample, SampleStatus

logger = logging.getLogger(__name__)

DUMP_SUBDIR = "rollouts"
"""Under `--dump-details DIR`: one directory per adapter."""
MAX_PENDING = 4
"""Batches handed over and not written yet; a fifth drops the oldest."""
CLOSE_TIMEOUT_S = 60.0
"""How long `close` waits for the pending batches to be written."""


@dataclass(frozen=True)
class AdapterAtDump:
    """What a dump file says of its adapter besides the samples."""

    step: int
    """Its step after the batch's commit."""
    registration_id: str
    loss: LossSettings
    """Its loss and advantage settings (the advantages are computed from them)."""


@dataclass(frozen=True)
class DumpJob:
    """One trained batch, handed from the loop to the writer thread."""

    rollout: RolloutBatch
    adapters: dict[str, AdapterAtDump]
    """The batch's adapters to write (those the dump knows; see `RolloutDump.submit`)."""
    time: float
    """Unix seconds at hand-over."""


class DumpWriter(Protocol):
    """Writes one batch (in the writer thread)."""

    def write(self, job: DumpJob) -> None: ...


def dump_file_name(rollout_id: int) -> str:
    return f"rollout_{rollout_id:08d}.json"


def sample_advantages(samples: Sequence[Sample], group_sizes: Sequence[int],
                      settings: LossSettings) -> list[float | None]:
    """The sequence-level advantage of each of one adapter's samples (whole prompt groups),
    as the train group computes it (`batch_advantages`): a per-token estimator's value at
    the sample's first trained token. None where it needs the KL to the base model, and
    for a per-token estimator's sample that trains on no token."""
    if not samples:
        return []
    if needs_reward_kl(settings):
        return [None] * len(samples)
    values = batch_advantages(samples, group_sizes, {samples[0].adapter: settings})
    out: list[float | None] = []
    for sample, value in zip(samples, values):
        if not isinstance(value, list):  # SAMPLE_LEVEL_ESTIMATORS: one value on every token
            out.append(float(value))
            continue
        mask = sample.loss_mask if sample.loss_mask is not None else [1] * sample.response_length
        first = next((t for t, m in enumerate(mask) if m), None)
        out.append(None if first is None else float(value[first]))
    return out


@dataclass(frozen=True)
class DumpGroup:
    samples: list[Sample]
    version: int | None
    """The slot version it was submitted at; None when the batch does not record it."""


def adapter_groups(rollout: RolloutBatch) -> dict[str, list[DumpGroup]]:
    """Per adapter: its prompt groups in the batch, in batch order."""
    out: dict[str, list[DumpGroup]] = {}
    start = 0
    for g, size in enumerate(rollout.prompt_group_sizes):
        samples = rollout.samples[start:start + size]
        start += size
        version = rollout.group_versions[g] if g < len(rollout.group_versions) else None
        out.setdefault(samples[0].adapter, []).append(DumpGroup(samples, version))
    return out


def rollout_document(name: str, job: DumpJob, groups: list[DumpGroup],
                     token_texts: Callable[[list[int]], list[str] | None]) -> dict[str, Any]:
    """One adapter's file (the shape in the module docstring)."""
    adapter = job.adapters[name]
    samples = [s for group in groups for s in group.samples]
    advantages = iter(sample_advantages(samples, [len(group.samples) for group in groups], adapter.loss))
    return {
        "adapter": name, "rollout_id": job.rollout.rollout_id, "step": adapter.step,
        "registration_id": adapter.registration_id, "time": job.time,
        "groups": [{
            "group_index": group.samples[0].group_index, "version": group.version,
            "prompt": group.samples[0].prompt, "label": group.samples[0].label,
            "samples": [{
                "index": s.index, "response": s.response, "reward": _finite(s.reward),
                "advantage": _finite(next(advantages)), "status": s.status.value,
                "truncated": s.status is SampleStatus.TRUNCATED, "aborted": s.status is SampleStatus.ABORTED,
                "tokens": token_texts(s.response_ids),
                "logprobs": [_finite(v) for v in s.rollout_logprobs] if s.rollout_logprobs else None,
                "loss_mask": None if s.loss_mask is None else list(s.loss_mask),
            } for s in group.samples],
        } for group in groups],
    }


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else float(value)


class TokenTexts:
    """The text of each token id alone, as a person reads it: decoded by the tokenizer (no
    byte-level `Ġ` or SentencePiece `▁` markers; the space a `▁` stands for is kept)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, ids: list[int]) -> list[str]:
        return [self._text(i) for i in ids]

    def _text(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and piece.startswith("\u2581") and not text.startswith(" "):
                text = " " + text  # SentencePiece drops a leading space when a token is decoded alone
            self._cache[token_id] = text
        return text


class RolloutFiles:
    """The `DumpWriter` of `--dump-details`: atomic JSON files, the newest `keep` per adapter."""

    def __init__(self, root: Path | str, keep: int, load_tokenizer: Callable[[], Any]) -> None:
        if keep <= 0:
            raise ValueError(f"--dump-details-keep must be > 0, got {keep}")
        self.root = Path(root)
        """`DIR/rollouts`."""
        self.keep = keep
        self._load_tokenizer = load_tokenizer
        self._token_texts: TokenTexts | None = None
        self._tokenizer_failed = False
        self._written: dict[str, list[str]] = {}
        """Per adapter: the files this writer wrote and still keeps, oldest first."""

    def token_texts(self, ids: list[int]) -> list[str] | None:
        """Loads the tokenizer on first use (in the writer thread); None if it cannot be loaded."""
        if self._token_texts is None and not self._tokenizer_failed:
            try:
                self._token_texts = TokenTexts(self._load_tokenizer())
            except Exception as exc:  # any loader error: the files go on without per-token texts
                self._tokenizer_failed = True
                logger.warning("Rollout dump: no tokenizer (%s); files carry no per-token texts", exc)
        return None if self._token_texts is None else self._token_texts(ids)

    def write(self, job: DumpJob) -> None:
        for name, groups in adapter_groups(job.rollout).items():
            if name not in job.adapters:
                continue
            if not ADAPTER_NAME_PATTERN.match(name) or name in (".", ".."):
                logger.warning("Rollout dump: adapter name %r is not a safe directory name; not dumped", name)
                continue
            directory = self.root / name
            directory.mkdir(parents=True, exist_ok=True)
            document = rollout_document(name, job, groups, self.token_texts)
            file_name = dump_file_name(job.rollout.rollout_id)
            write_atomically(directory / file_name, json.dumps(document, ensure_ascii=False, allow_nan=False))
            self._prune(name, directory, file_name)

    def _prune(self, name: str, directory: Path, written: str) -> None:
        """Keep the `keep` files written last: this writer's own in the order it wrote them,
        after any found there (an earlier run's, whose rollout ids may be higher: oldest by
        modification time first)."""
        own = self._written.setdefault(name, [])
        if written in own:
            own.remove(written)
        own.append(written)
        on_disk = {entry.name: entry.stat().st_mtime_ns for entry in os.scandir(directory)
                   if entry.name.startswith("rollout_") and entry.name.endswith(".json")}
        order = sorted((n for n in on_disk if n not in own), key=lambda n: (on_disk[n], n)) + own
        for stale in order[:-self.keep]:
            (directory / stale).unlink(missing_ok=True)
        del own[:-self.keep]


def write_atomically(path: Path, text: str) -> None:
    """`path` appears whole or not at all: written to a dot-file beside it, then renamed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


class RolloutDump:
    """Takes trained batches from the loop (`submit`, no waiting) and writes them in a
    background thread; `close` writes what is pending and stops it."""

    def __init__(self, writer: DumpWriter, *, default_loss: LossSettings, max_pending: int = MAX_PENDING,
                 clock: Callable[[], float] = time.time) -> None:
        if max_pending <= 0:
            raise ValueError(f"max_pending must be > 0, got {max_pending}")
        self.writer = writer
        self.default_loss = default_loss
        """The trainer's loss flags: the settings of an adapter whose config has none."""
        self.max_pending = max_pending
        self.clock = clock
        self.dropped = 0
        """Batches dropped because the writer fell behind."""
        self.submitted = 0
        self.submit_seconds = 0.0
        """Time `submit` took on the loop, all calls together."""
        self.written = 0
        self.write_seconds = 0.0
        """Time the writer thread spent writing, all batches together."""
        self._known: dict[str, AdapterAtDump] = {}
        """Each adapter as the latest snapshot that held it showed it."""
        self._loss: dict[str, LossSettings] = {}
        """Loss settings by registration id (a registration's config never changes)."""
        self._pending: deque[DumpJob] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="rollout-dump", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> RolloutDump | None:
        """The dump `--dump-details` asks for (None without it); the tokenizer is `--hf-checkpoint`'s."""
        if cfg.dump_details is None:
            return None

        def load_tokenizer() -> Any:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(cfg.hf_checkpoint)

        root = Path(cfg.dump_details) / DUMP_SUBDIR
        logger.info("Dumping the latest %d trained batches of each adapter to %s", cfg.dump_details_keep, root)
        return cls(RolloutFiles(root, cfg.dump_details_keep, load_tokenizer), default_loss=cfg.loss)

    def submit(self, rollout: RolloutBatch, snapshot: MultiLoRASnapshot) -> None:
        """Hand a trained batch to the writer; `snapshot` is the one taken after its commit. An
        adapter not live in it (it failed meanwhile) is written as the latest snapshot that
        held it showed it. Never waits on the writer."""
        start = time.perf_counter()
        for name, run in snapshot.live.items():
            loss = self._loss.get(run.registration_id)
            if loss is None:
                loss = self._loss[run.registration_id] = (
                    self.default_loss if run.config.loss is None else run.config.loss_settings())
            self._known[name] = AdapterAtDump(run.step, run.registration_id, loss)
        adapters = {name: self._known[name] for name in rollout.groups_per_adapter if name in self._known}
        job = DumpJob(rollout, adapters, self.clock())
        with self._cond:
            if self._closing:
                raise RuntimeError("RolloutDump.submit after close")
            if len(self._pending) >= self.max_pending:
                lost = self._pending.popleft()
                self.dropped += 1
                if self.dropped == 1:
                    logger.warning("Rollout dump fell behind: rollout %d not dumped (the oldest waiting); "
                                   "further drops are counted and reported at exit", lost.rollout.rollout_id)
            self._pending.append(job)
            self._cond.notify()
        self.submitted += 1
        self.submit_seconds += time.perf_counter() - start

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                job = self._pending.popleft()
            start = time.perf_counter()
            try:
                self.writer.write(job)
            except Exception:  # a debugging aid: a failed write is logged, training goes on
                logger.exception("Rollout dump of rollout %d failed", job.rollout.rollout_id)
            self.written += 1
            self.write_seconds += time.perf_counter() - start

    def close(self) -> None:
        """Write the pending batches (waiting up to CLOSE_TIMEOUT_S) and stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("Rollout dump: %d batches still unwritten after %.0fs; leaving them",
                           len(self._pending), CLOSE_TIMEOUT_S)
        submit_ms = 1e3 * self.submit_seconds / self.submitted if self.submitted else 0.0
        write_ms = 1e3 * self.write_seconds / self.written if self.written else 0.0
        logger.info("Rollout dump: %d batches handed over (%.3f ms each on the loop), %d written (%.1f ms each "
                    "in the writer thread), %d dropped", self.submitted, submit_ms, self.written, write_ms,
                    self.dropped)
