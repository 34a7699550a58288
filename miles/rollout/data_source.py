"""Per-adapter prompt streams: what the producer draws its prompts from.

`MultiLoRADataSource` loads each live adapter's dataset in the background (files are
read and checked by `miles.rollout.datasets`), drops prompts longer than
`--rollout-max-prompt-len` tokens, streams its rows in file order or, with
`--rollout-shuffle`, in an order seeded by `--rollout-seed` and reshuffled every epoch
(`AdapterDataset`), and turns a row into a tokenized `PromptItem`.
Where a stream stands is a `DataPosition`, saved with checkpoints and restored on resume:

    source = MultiLoRADataSource(DataSourceConfig(seed=1, apply_chat_template=False,
                                                  default_rm_type=None, shuffle=True), tokenizer)
    source.sync(snapshot)                    # start loading new registrations
    item = source.next_prompt(run)           # once source.ready(run)
    positions = source.positions()           # {"a": DataPosition(epoch=0, index=1)}
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
from dataclasses import dataclass
from typing import Any

from miles.rollout.datasets import check_rows, read_rows, validate_dataset
from miles.rollout.rewards import RewardSpec
from miles.utils.adapter_config import resolved_field
from miles.utils.arguments import MilesConfig
from miles.utils.types import AdapterRun, DataPosition, MultiLoRASnapshot, Sample

logger = logging.getLogger(__name__)


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
    """One adapter's rows, epoch after epoch; never runs out.

    With a `seed`, the order of epoch `e` is a shuffle seeded by `(seed, e)` alone; without
    one, every epoch is in file order. Either way a `DataPosition(epoch, index)` is enough
    to continue the stream exactly: `seek` there and the next rows are the ones an
    uninterrupted stream would have given.
    """

    def __init__(self, rows: list[dict[str, Any]], seed: str | None) -> None:
        if not rows:
            raise ValueError("an adapter dataset needs at least one row")
        self.rows = rows
        self.seed = seed
        self.epoch = 0
        self._order = self._epoch_order(0)
        self._index = 0

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.seed is not None:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    @property
    def served(self) -> int:
        """Prompts handed out since the stream's start (epoch 0, index 0)."""
        return self.epoch * len(self.rows) + self._index

    def next_row(self) -> tuple[int, dict[str, Any]]:
        """(stream index, row); wraps to a new shuffled epoch after the last row."""
        if self._index == len(self._order):
            self.epoch += 1
            self._order = self._epoch_order(self.epoch)
            self._index = 0
        stream_index = self.served
        row = self.rows[self._order[self._index]]
        self._index += 1
        return stream_index, row

    def position(self) -> DataPosition:
        """Where the next `next_row` reads: the next row not yet handed out."""
        if self._index == len(self._order):
            return DataPosition(epoch=self.epoch + 1, index=0)
        return DataPosition(epoch=self.epoch, index=self._index)

    def seek(self, position: DataPosition) -> None:
        """Continue from `position`. An index past the end (the file shrank since the
        position was saved) starts the next epoch."""
        epoch, index = position.epoch, position.index
        if index >= len(self.rows):
            logger.warning("Data position %s is past the %d rows of the dataset; starting epoch %d",
                           position, len(self.rows), epoch + 1)
            epoch, index = epoch + 1, 0
        self.epoch = epoch
        self._order = self._epoch_order(epoch)
        self._index = index


@dataclass(frozen=True)
class DataSourceConfig:
    seed: int
    """`--rollout-seed`: with `shuffle`, an adapter's order is seeded by it and the adapter's name."""
    apply_chat_template: bool
    """Also wrap plain-string prompts as one user message and apply the chat template."""
    default_rm_type: str | None
    """`--rm-type`, the last resort of reward resolution."""
    shuffle: bool = False
    """`--rollout-shuffle`: a new seeded order every epoch; off: file order."""
    max_prompt_len: int | None = None
    """`--rollout-max-prompt-len`: rows whose prompt is longer (in tokens) are dropped on load."""

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> DataSourceConfig:
        return cls(seed=cfg.rollout_seed, apply_chat_template=cfg.apply_chat_template, default_rm_type=cfg.rm_type,
                   shuffle=cfg.rollout_shuffle, max_prompt_len=cfg.rollout_max_prompt_len)


@dataclass
class _Loaded:
    registration_id: str
    dataset: AdapterDataset


class MultiLoRADataSource:
    """The datasets of every live adapter, loaded in the background as adapters appear.

    `sync(snapshot)` starts loading (off the event loop) the dataset of every live
    adapter not loaded for its current registration and forgets the others. A dataset
    that fails to load disables that registration only (logged), never the other
    adapters. `num_step` is not this class's business: the controller fixed it when the
    adapter registered.

    Data positions (for resume): `positions()` says, per adapter, where its stream
    continues: the next prompt not yet handed to generation. Prompts already handed
    out (in flight, buffered, or in a batch not yet trained) are past the position, so
    a resume from it does not replay them: at most about one step of prompts
    (`--rollout-buffer-steps` x `rollout_batch_size` groups) is skipped, and none is
    repeated. `restore(name, registration_id, position)` continues a registration's
    stream from a saved position; it is honoured whether the dataset is loaded yet or
    not, as long as no prompt of that registration was drawn (it is meant for PENDING
    adapters, which the producer does not sample).
    """

    def __init__(self, config: DataSourceConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self._loaded: dict[str, _Loaded] = {}
        self._loading: dict[str, tuple[str, asyncio.Task[None]]] = {}
        self._restores: dict[str, tuple[str, DataPosition]] = {}
        """name -> (registration id, position) to seek to once that registration's dataset loads."""
        self._left: dict[str, tuple[str, DataPosition]] = {}
        """name -> (registration id, last position) of datasets forgotten because their
        adapter stopped being live (its final save still wants the position)."""
        self.failed: dict[str, str] = {}
        """registration id -> why its dataset could not be used."""

    def sync(self, snapshot: MultiLoRASnapshot) -> None:
        live = snapshot.live
        for name, loaded in list(self._loaded.items()):
            run = live.get(name)
            if run is None:
                self._left[name] = (loaded.registration_id, loaded.dataset.position())
            if run is None or run.registration_id != loaded.registration_id:
                del self._loaded[name]
        for name, (registration_id, task) in list(self._loading.items()):
            if name not in live or live[name].registration_id != registration_id:
                task.cancel()
                del self._loading[name]
        for name, run in live.items():
            if name in self._left and self._left[name][0] != run.registration_id:
                del self._left[name]
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
            input_key = resolved_field(cfg.input_key, "input_key")
            rows = await asyncio.to_thread(read_rows, cfg.data)
            if not rows:
                raise ValueError(f"dataset {cfg.data}: empty, it needs at least one row")
            check_rows(rows, cfg.data, input_key, cfg.label_key)
            if self.config.max_prompt_len is not None:
                rows = await asyncio.to_thread(
                    keep_short_prompts, rows, cfg.data, input_key, self.tokenizer,
                    self.config.max_prompt_len, self.config.apply_chat_template)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one adapter's bad data must not stop the others
            self.failed[run.registration_id] = str(exc)
            logger.error("Adapter %r: dataset not used, no samples will be generated for it: %s", run.name, exc)
            return
        finally:
            if self._loading.get(run.name, ("",))[0] == run.registration_id:
                del self._loading[run.name]
        dataset = AdapterDataset(rows, f"{self.config.seed}:{run.name}" if self.config.shuffle else None)
        restore = self._restores.get(run.name)
        if restore is not None and restore[0] == run.registration_id:
            del self._restores[run.name]
            dataset.seek(restore[1])
        self._loaded[run.name] = _Loaded(run.registration_id, dataset)
        self._left.pop(run.name, None)
        logger.info("Adapter %r: loaded %d rows from %s, continuing at %s", run.name, len(rows), cfg.data,
                    dataset.position())

    def restore(self, name: str, registration_id: str, position: DataPosition) -> None:
        """Continue registration `registration_id` of `name` from `position` (see the class doc)."""
        loaded = self._loaded.get(name)
        if loaded is not None and loaded.registration_id == registration_id:
            loaded.dataset.seek(position)
        else:  # applied when this registration's dataset has loaded
            self._restores[name] = (registration_id, position)
        logger.info("Adapter %r: data stream continues at %s", name, position)

    def positions(self) -> dict[str, DataPosition]:
        """Per adapter, where its stream continues. A loaded dataset says where it is; a
        registration still loading, its pending restore; an adapter no longer live,
        where its stream stopped."""
        positions = {name: position for name, (_, position) in self._left.items()}
        positions.update({name: position for name, (_, position) in self._restores.items()})
        positions.update({name: loaded.dataset.position() for name, loaded in self._loaded.items()})
        return positions

    def next_prompt(self, run: AdapterRun) -> PromptItem:
        """The adapter's next prompt, tokenized (the dataset must be `ready`)."""
        cfg = run.config
        input_key = resolved_field(cfg.input_key, "input_key")
        group_index, row = self._loaded[run.name].dataset.next_row()
        prompt = self._render(row[input_key])
        label_value = row.get(cfg.label_key) if cfg.label_key else None
        return PromptItem(
            adapter=run.name, slot=run.slot, group_index=group_index, prompt=prompt,
            prompt_ids=self._encode(prompt, templated=self._templated(row[input_key])),
            label=None if label_value is None else str(label_value),
            metadata={**cfg.metadata, **_row_metadata(row, cfg.metadata_key, run.name)},
            reward=RewardSpec(cfg.rm_type, cfg.custom_rm_path, self.config.default_rm_type),
        )

    def _templated(self, prompt: Any) -> bool:
        return is_templated(prompt, self.config.apply_chat_template)

    def _render(self, prompt: Any) -> str:
        return render_prompt(self.tokenizer, prompt, self.config.apply_chat_template)

    def _encode(self, text: str, templated: bool) -> list[int]:
        # A chat template writes its own special tokens; a raw prompt gets the model's BOS.
        return list(self.tokenizer.encode(text, add_special_tokens=not templated))

    async def close(self) -> None:
        tasks = [task for _, task in self._loading.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._loading.clear()


def is_templated(prompt: Any, apply_chat_template: bool) -> bool:
    """Chat messages always go through the chat template; a string only with --apply-chat-template."""
    return not isinstance(prompt, str) or apply_chat_template


def render_prompt(tokenizer: Any, prompt: Any, apply_chat_template: bool) -> str:
    """The prompt text the engine sees."""
    if not is_templated(prompt, apply_chat_template):
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def keep_short_prompts(rows: list[dict[str, Any]], path: str, input_key: str, tokenizer: Any,
                       max_prompt_len: int, apply_chat_template: bool) -> list[dict[str, Any]]:
    """The rows whose rendered prompt is at most `max_prompt_len` tokens (counted without
    special tokens, as Miles counts); ValueError when none is left."""
    kept = [row for row in rows
            if len(tokenizer.encode(render_prompt(tokenizer, row[input_key], apply_chat_template),
                                    add_special_tokens=False)) <= max_prompt_len]
    if len(kept) < len(rows):
        logger.info("dataset %s: %d of %d prompts are longer than --rollout-max-prompt-len %d tokens; dropped",
                    path, len(rows) - len(kept), len(rows), max_prompt_len)
    if not kept:
        raise ValueError(f"dataset {path}: every prompt is longer than "
                         f"--rollout-max-prompt-len {max_prompt_len} tokens")
    return kept


@functools.cache
def _cached_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@dataclass(frozen=True)
class DatasetCheck:
    """The controller's dataset hook (`ControllerHooks.validate_dataset`) with the data flags:
    `(path, input_key, label_key) -> rows`, counting only the rows whose prompt fits
    `--rollout-max-prompt-len`, so `num_step` is derived after the filter, as in Miles.
    Plain data, so it travels to the controller's actor; the tokenizer loads there once."""

    tokenizer_path: str | None
    max_prompt_len: int | None = None
    apply_chat_template: bool = False

    @classmethod
    def from_config(cls, cfg: MilesConfig) -> DatasetCheck:
        return cls(tokenizer_path=cfg.hf_checkpoint, max_prompt_len=cfg.rollout_max_prompt_len,
                   apply_chat_template=cfg.apply_chat_template)

    def __call__(self, path: str, input_key: str, label_key: str | None) -> int:
        rows = validate_dataset(path, input_key, label_key)
        if self.max_prompt_len is None:
            return rows
        if self.tokenizer_path is None:
            raise ValueError("--rollout-max-prompt-len needs --hf-checkpoint (its tokenizer counts the tokens)")
        try:
            tokenizer = _cached_tokenizer(self.tokenizer_path)
        except OSError as exc:
            raise ValueError(f"cannot load the tokenizer of {self.tokenizer_path} "
                             f"to count prompt tokens ({exc})") from exc
        return len(keep_short_prompts(read_rows(path), path, input_key, tokenizer, self.max_prompt_len,
                                      self.apply_chat_template))


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
