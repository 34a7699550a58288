"""Per-adapter prompt datasets: reading jsonl/json/parquet files and streaming samples.

`validate_dataset(path, input_key, label_key)` runs when an adapter registers, so a bad
file is a 400 at the control plane; `AdapterDataset` is what the producer draws prompts
from (seeded shuffle per adapter, wrapping around epochs).

    rows = validate_dataset("data/gsm8k.jsonl", "text", "label")
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.rollout.rewards import RewardSpec
from miles.utils.arguments import MilesConfig
from miles.utils.types import AdapterRun, MultiLoRASnapshot, Sample

logger = logging.getLogger(__name__)

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet")


def read_rows(path: str) -> list[dict[str, Any]]:
    """All rows of a jsonl, json (a list of objects) or parquet file; ValueError if bad."""
    file = Path(path)
    suffix = file.suffix.lower()
    if suffix not in SUPPORTED_EXTENSIONS:
        raise ValueError(f"dataset {path}: unsupported extension {suffix or '(none)'!r}; use one of jsonl, json, parquet")
    if not file.is_file():
        raise ValueError(f"dataset {path}: no such file")
    try:
        rows = _READERS[suffix](file)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"dataset {path}: cannot be read ({exc})") from exc
    for number, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"dataset {path}: row {number} is a {type(row).__name__}, expected an object")
    return rows


def _read_jsonl(file: Path) -> list[Any]:
    rows = []
    with file.open(encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"line {line_number} is not valid JSON: {exc}") from exc
    return rows


def _read_json(file: Path) -> list[Any]:
    data = json.loads(file.read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"expected a JSON list of rows, got a {type(data).__name__}")
    return data


def _read_parquet(file: Path) -> list[Any]:
    import pyarrow.parquet as pq
    from pyarrow import ArrowException

    try:
        return pq.read_table(file).to_pylist()
    except ArrowException as exc:
        raise ValueError(str(exc)) from exc


_READERS = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def check_rows(rows: list[dict[str, Any]], path: str, input_key: str, label_key: str | None) -> None:
    """ValueError naming the first missing key (and the keys the rows do have) or the
    first prompt that is neither a string nor a list of chat messages."""
    required = [input_key] + ([label_key] if label_key is not None else [])
    for number, row in enumerate(rows):
        for key in required:
            if key not in row:
                kind = "input_key" if key == input_key else "label_key"
                raise ValueError(
                    f"dataset {path}: row {number} has no {kind} {key!r}; "
                    f"keys present: {sorted(row)}. Set {kind} in the adapter config to one of them"
                )
        prompt = row[input_key]
        if not isinstance(prompt, str) and not _is_messages(prompt):
            raise ValueError(
                f"dataset {path}: row {number}: {input_key!r} must be a string or a list of "
                f"{{'role', 'content'}} messages, got {type(prompt).__name__}"
            )


def validate_dataset(path: str, input_key: str, label_key: str | None) -> int:
    """Read and check a dataset at registration; returns its row count."""
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"dataset {path}: empty, it needs at least one row")
    check_rows(rows, path, input_key, label_key)
    return len(rows)


@dataclass(frozen=True)
class PromptItem:
    """One prompt drawn for an adapter: everything its group's samples start from."""

    adapter: str
    slot: int
    group_index: int
    """Position in the adapter's prompt stream (counts across epochs, so unique)."""
    prompt: str
    prompt_ids: list[int]
    label: str | None
    metadata: dict[str, Any]
    """The adapter config's `metadata` updated with the row's (row keys win)."""
    reward: RewardSpec

    def new_samples(self, n: int) -> list[Sample]:
        return [
            Sample(adapter=self.adapter, slot=self.slot, group_index=self.group_index, index=i,
                   prompt=self.prompt, label=self.label, metadata=dict(self.metadata),
                   prompt_ids=list(self.prompt_ids))
            for i in range(n)
        ]


class AdapterDataset:
    """One adapter's rows in a seeded order, reshuffled at every epoch; never runs out."""

    def __init__(self, rows: list[dict[str, Any]], seed: str) -> None:
        if not rows:
            raise ValueError("an adapter dataset needs at least one row")
        self.rows = rows
        self._rng = random.Random(seed)
        self._order: list[int] = []
        self._position = 0
        self.epoch = -1
        self.served = 0

    def next_row(self) -> tuple[int, dict[str, Any]]:
        """(stream index, row); wraps to a new shuffled epoch after the last row."""
        if self._position == len(self._order):
            self._order = list(range(len(self.rows)))
            self._rng.shuffle(self._order)
            self._position = 0
            self.epoch += 1
        row = self.rows[self._order[self._position]]
        self._position += 1
        self.served += 1
        return self.served - 1, row


@dataclass(frozen=True)
class DataSourceConfig:
    seed: int
    apply_chat_template: bool
    """Also wrap plain-string prompts as one user message and apply the chat template."""
    default_rm_type: str | None
    """`--rm-type`, the last resort of reward resolution."""

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> DataSourceConfig:
        return cls(seed=cfg.seed, apply_chat_template=cfg.apply_chat_template, default_rm_type=cfg.rm_type)


@dataclass
class _Loaded:
    registration_id: str
    dataset: AdapterDataset


class MultiLoRADataSource:
    """The datasets of every live adapter, loaded in the background as adapters appear.

    `sync(snapshot)` starts loading (off the event loop) the dataset of every live
    adapter not loaded for its current registration and forgets the others; once
    loaded, `controller.resolve_num_step(name, rows)` is called. A dataset that fails
    to load disables that registration only (logged), never the other adapters.
    """

    def __init__(self, config: DataSourceConfig, tokenizer: Any, controller: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.controller = controller
        self._loaded: dict[str, _Loaded] = {}
        self._loading: dict[str, tuple[str, asyncio.Task[None]]] = {}
        self.failed: dict[str, str] = {}
        """registration id -> why its dataset could not be used."""

    def sync(self, snapshot: MultiLoRASnapshot) -> None:
        live = snapshot.live
        for name in [n for n, loaded in self._loaded.items()
                     if n not in live or live[n].registration_id != loaded.registration_id]:
            del self._loaded[name]
        for name, (registration_id, task) in list(self._loading.items()):
            if name not in live or live[name].registration_id != registration_id:
                task.cancel()
                del self._loading[name]
        for name, run in live.items():
            if self.ready(run) or name in self._loading or run.registration_id in self.failed:
                continue
            task = asyncio.create_task(self._load(run), name=f"load-dataset-{name}")
            self._loading[name] = (run.registration_id, task)

    def ready(self, run: AdapterRun) -> bool:
        loaded = self._loaded.get(run.name)
        return loaded is not None and loaded.registration_id == run.registration_id

    async def _load(self, run: AdapterRun) -> None:
        cfg = run.config
        try:
            rows = await asyncio.to_thread(read_rows, cfg.data)
            if not rows:
                raise ValueError(f"dataset {cfg.data}: empty, it needs at least one row")
            check_rows(rows, cfg.data, cfg.input_key, cfg.label_key)
            await self.controller.resolve_num_step.remote(run.name, len(rows))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one adapter's bad data must not stop the others
            self.failed[run.registration_id] = str(exc)
            logger.error("Adapter %r: dataset not used, no samples will be generated for it: %s", run.name, exc)
            return
        finally:
            if self._loading.get(run.name, ("",))[0] == run.registration_id:
                del self._loading[run.name]
        self._loaded[run.name] = _Loaded(run.registration_id, AdapterDataset(rows, f"{self.config.seed}:{run.name}"))
        logger.info("Adapter %r: loaded %d rows from %s", run.name, len(rows), cfg.data)

    def next_prompt(self, run: AdapterRun) -> PromptItem:
        """The adapter's next prompt, tokenized (the dataset must be `ready`)."""
        cfg = run.config
        group_index, row = self._loaded[run.name].dataset.next_row()
        prompt = self._render(row[cfg.input_key])
        label_value = row.get(cfg.label_key) if cfg.label_key else None
        return PromptItem(
            adapter=run.name, slot=run.slot, group_index=group_index, prompt=prompt,
            prompt_ids=self._encode(prompt, templated=self._templated(row[cfg.input_key])),
            label=None if label_value is None else str(label_value),
            metadata={**cfg.metadata, **_row_metadata(row, cfg.metadata_key, run.name)},
            reward=RewardSpec(cfg.rm_type, cfg.custom_rm_path, self.config.default_rm_type),
        )

    def _templated(self, prompt: Any) -> bool:
        return not isinstance(prompt, str) or self.config.apply_chat_template

    def _render(self, prompt: Any) -> str:
        if not self._templated(prompt):
            return prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _encode(self, text: str, templated: bool) -> list[int]:
        # A chat template writes its own special tokens; a raw prompt gets the model's BOS.
        return list(self.tokenizer.encode(text, add_special_tokens=not templated))

    async def close(self) -> None:
        tasks = [task for _, task in self._loading.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loading.clear()


def _row_metadata(row: dict[str, Any], key: str | None, adapter: str) -> dict[str, Any]:
    value = row.get(key) if key else None
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = None
    if not isinstance(value, dict):
        logger.warning("Adapter %r: row metadata %r is not an object; ignored", adapter, key)
        return {}
    return value
