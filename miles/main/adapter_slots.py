"""Reconcile and saves: the adapters the training backend holds in its slots.

    snapshot = await slots.reconcile(snapshot)   # retire -> save and clean up those that left -> page out
                                                 # idle client models -> load new (and paged-in) ones
    await slots.save(snapshot)                   # on each adapter's --save-interval
    await slots.save_all()                       # at shutdown

`AdapterSlots` is the only component that loads adapters into the backend's slots and takes
them out (DESIGN §6 "Reconcile"), and the only one that writes checkpoints. An adapter's step
lives in the registry and is read from snapshots; the backend holds weights and optimizer
state; the rollout manager owns each adapter's data position, which a save records in
`trainer_state.json` and a resume hands back. Loading an adapter makes it stale for the
weight push (`WeightPush.mark_stale`), unless early activation already pushed its fresh
weights (`EarlyActivation.claim`).

Client-driven adapters (Tinker models, `snapshot.clients`) are loaded and cleaned up here
too, but never pushed and never saved on a cadence or at shutdown: their client saves them
(`save_state`), and a restarted trainer loads each from its latest such save. With
`idle_evict_s` (`--multi-lora-idle-evict-s`), one idle that long with no command in flight is
paged out: its whole state (weights, moments, pending gradient, clock) is written to
`{save}/paged`, its slot emptied and freed (PAGED); its next command pages it back in (the
gateway gives it a free slot, PENDING) and it is loaded from there like a resumed model, so it
goes on exactly where it stopped, in this trainer or a restarted one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from miles.backends.base import AdapterSpec, SaveRequest, TrainingBackend
from miles.main.early_activation import EarlyActivation
from miles.main.handles import ControllerHandle, RolloutManagerHandle
from miles.main.weight_push import WeightPush
from miles.utils.adapter_config import resolved_field
from miles.utils.types import DataPosition, MultiLoRASnapshot
from miles.utils.types.lifecycle_ops import ActivateClients, FreeSlots, RetireAdapters, SetStep

logger = logging.getLogger(__name__)

PAGED_DIR = "paged"
"""Where, under a client model's save directory, its state goes while it is paged out."""


@dataclass
class LoadedAdapter:
    """An adapter the backend holds, as of the latest snapshot."""

    registration_id: str
    slot: int
    saves: bool
    """It has a save directory."""
    samples_per_group: int
    """Its `n_samples_per_prompt`."""
    step: int
    """The registry's step (a copy, never counted here)."""
    accumulated_groups: int
    """The registry's groups toward the next step (a copy)."""
    saved: tuple[int, int]
    """(step, accumulated groups) of the checkpoint last written or resumed from."""
    client: bool = False
    """Client-driven: its client saves it; the loop never does."""

    @property
    def progress(self) -> tuple[int, int]:
        return self.step, self.accumulated_groups


class AdapterSlots:
    def __init__(self, backend: TrainingBackend, controller: ControllerHandle, rollout_manager: RolloutManagerHandle,
                 push: WeightPush, activation: EarlyActivation, *, save_interval: int | None = None,
                 idle_evict_s: float = 0.0) -> None:
        self.backend = backend
        self.controller = controller
        self.rollout_manager = rollout_manager
        self.push = push
        self.activation = activation
        self.save_interval = save_interval
        self.idle_evict_s = idle_evict_s
        """Page out a client model idle this long (0: never)."""
        self.loaded: dict[str, LoadedAdapter] = {}

    def loaded_clients(self) -> list[str]:
        """The client-driven models in their slots."""
        return sorted(name for name, entry in self.loaded.items() if entry.client)

    def _observe(self, snapshot: MultiLoRASnapshot) -> None:
        live = snapshot.live
        for name, entry in self.loaded.items():
            run = live.get(name)
            if run is not None and run.registration_id == entry.registration_id:
                entry.step, entry.accumulated_groups = run.step, run.accumulated_groups
            client = snapshot.clients.get(name)
            if client is not None and client.registration_id == entry.registration_id:
                entry.step = client.step

    # ---- reconcile ----------------------------------------------------------------------

    async def reconcile(self, snapshot: MultiLoRASnapshot) -> MultiLoRASnapshot:
        """Retire RETIRING adapters, save and clean up those that left, page out idle client
        models, load the new (and paged-in) ones."""
        self._observe(await self.push.settle(snapshot))  # not None: a snapshot went in
        snapshot = await self.controller.apply.remote(RetireAdapters())
        snapshot = await self._cleanup(snapshot)
        snapshot = await self._page_out_idle(snapshot)
        return await self._load(snapshot)

    async def _page_out_idle(self, snapshot: MultiLoRASnapshot) -> MultiLoRASnapshot:
        """Write each idle client model's whole state to `{save}/paged`, empty its slot, and have
        the controller free it (PAGED). One whose command came in meanwhile is loaded back from
        what was just written, exactly as it was."""
        if self.idle_evict_s <= 0:
            return snapshot
        paged = []
        for name in await self.controller.idle_client_models.remote(self.idle_evict_s):
            run, entry = snapshot.clients.get(name), self.loaded.get(name)
            if run is None or entry is None or entry.registration_id != run.registration_id or run.config.save is None:
                continue
            directory = str(Path(run.config.save) / PAGED_DIR)
            try:
                await self.backend.save_client_state(name, directory, pending=True)
            except Exception as exc:  # it stays in its slot, untouched; the next reconcile tries again
                logger.warning("Client model '%s' could not be paged out (%s: %s); it keeps its slot", name,
                               type(exc).__name__, exc)
                continue
            await self.backend.cleanup_adapter(name)
            del self.loaded[name]
            if await self.controller.page_out_client.remote(name, directory):
                paged.append(name)
                continue
            await self.backend.load_adapter(AdapterSpec.for_client(run))
            await self.backend.load_client_state(name, directory, optimizer=True)
            self.loaded[name] = entry
            logger.info("Client model '%s' got a command while being paged out; it keeps its slot", name)
        if not paged:
            return snapshot
        logger.info("Paged out client models idle for %g s or more: %s", self.idle_evict_s, ", ".join(paged))
        return await self.controller.snapshot.remote()

    async def _cleanup(self, snapshot: MultiLoRASnapshot) -> MultiLoRASnapshot:
        live = {name: run.registration_id for name, run in snapshot.live.items()}
        live.update((name, run.registration_id) for name, run in snapshot.clients.items())
        gone = [name for name, entry in sorted(self.loaded.items()) if live.get(name) != entry.registration_id]
        positions = await self._data_positions() if gone else {}
        for name in gone:
            await self._save(name, positions.get(name))
            await self.backend.cleanup_adapter(name)
            entry = self.loaded.pop(name)
            if not entry.client:
                await self.push.unload(entry.slot)
                self.push.forget(name)
            logger.info("Adapter '%s' cleaned up", name)
        for slot in self.activation.left(snapshot):
            await self.push.unload(slot)
        if not snapshot.cleanup:  # also those never loaded here: nothing to save
            return snapshot
        return await self.controller.apply.remote(FreeSlots(sorted(snapshot.cleanup)))

    async def _load(self, snapshot: MultiLoRASnapshot) -> MultiLoRASnapshot:
        snapshot = await self._load_clients(snapshot)
        for name, run in sorted(snapshot.live.items()):
            if name in self.loaded:
                continue
            spec = AdapterSpec.from_run(run)
            loaded = await self.backend.load_adapter(spec)
            # A restored registry may be ahead of the weights (no checkpoint, or an older one):
            # the weights win, so the step and the groups accumulated toward the next one
            # always match what the backend holds.
            progress = (loaded.step, loaded.accumulated_groups)
            if loaded.checkpoint is not None or progress != (run.step, run.accumulated_groups):
                snapshot = await self.controller.apply.remote(SetStep(name, *progress))
            if loaded.miles_checkpoint:
                logger.info("Adapter '%s' starts from the LoRA weights of Miles' checkpoint %s (step %d), with a "
                            "fresh optimizer and LR clock and its data from the start", name, loaded.checkpoint,
                            loaded.step)
            elif loaded.checkpoint is not None:
                logger.info("Adapter '%s' resumed from %s (step %d)", name, loaded.checkpoint, loaded.step)
            elif loaded.step != run.step:
                logger.warning("Adapter '%s' had step %d but no checkpoint: it starts again from step %d",
                               name, run.step, loaded.step)
            if loaded.data_position is not None:
                # Before its first push: the adapter is PENDING, so nothing was sampled yet.
                await self.rollout_manager.restore_data_position.remote(name, run.registration_id,
                                                                        loaded.data_position)
            if not self.activation.claim(run) or loaded.checkpoint is not None:
                self.push.mark_stale([name])
            self.loaded[name] = LoadedAdapter(
                registration_id=run.registration_id, slot=run.slot, saves=spec.save_dir is not None,
                samples_per_group=resolved_field(run.config.n_samples_per_prompt, "n_samples_per_prompt"),
                step=loaded.step, accumulated_groups=loaded.accumulated_groups, saved=progress)
        return snapshot

    async def _load_clients(self, snapshot: MultiLoRASnapshot) -> MultiLoRASnapshot:
        """Client-driven models: fresh (A from the model's seed, B zero), or from their latest
        `save_state` with its optimizer state when a trainer restarts over them; ACTIVE once loaded."""
        new = [run for name, run in sorted(snapshot.clients.items()) if name not in self.loaded]
        for run in new:
            await self.backend.load_adapter(AdapterSpec.for_client(run))
            step = run.step
            if run.resume_from is not None:
                await self.backend.load_client_state(run.name, run.resume_from, optimizer=True)
                step = run.resume_step
                if step != run.step:  # its steps after that save went with the previous trainer
                    await self.controller.apply.remote(SetStep(run.name, step))
                    logger.warning("Client model '%s' resumed from %s at step %d: its %d optim_step(s) after "
                                   "that save are lost", run.name, run.resume_from, step, run.step - step)
                else:
                    how = "paged in" if Path(run.resume_from).name == PAGED_DIR else "resumed"
                    logger.info("Client model '%s' %s from %s (step %d)", run.name, how, run.resume_from, step)
            self.loaded[run.name] = LoadedAdapter(
                registration_id=run.registration_id, slot=run.slot, saves=False, samples_per_group=1,
                step=step, accumulated_groups=0, saved=(step, 0), client=True)
        if not new:
            return snapshot
        return await self.controller.apply.remote(ActivateClients([run.name for run in new]))

    # ---- checkpoints ----------------------------------------------------------------------

    async def save(self, snapshot: MultiLoRASnapshot) -> list[str]:
        """Save every loaded adapter whose step is a positive multiple of `save_interval`."""
        self._observe(snapshot)
        interval = self.save_interval
        if interval is None:
            return []
        due = [name for name, e in sorted(self.loaded.items())
               if e.saves and e.step > 0 and e.step % interval == 0 and e.step != e.saved[0]]
        if not due:
            return []
        positions = await self._data_positions()
        return [name for name in due if await self._save(name, positions.get(name))]

    async def save_all(self) -> list[str]:
        """Shutdown: save every loaded adapter that stepped or trained groups since its last
        checkpoint (the gradient of a step's unfinished window is saved with it)."""
        try:
            await self.push.settle()
        except Exception as exc:  # a failed push must not cost the adapters' weights
            logger.warning("The last weight push failed (%s); saving anyway", exc)
        if not self.loaded:
            return []
        # Re-read: shutdown may come at any stage of an iteration.
        self._observe(await self.controller.snapshot.remote())
        try:
            positions = await self._data_positions()
        except Exception as exc:  # a dead rollout manager must not cost the adapters' weights
            logger.warning("Data positions unavailable (%s); saving without them", exc)
            positions = {}
        return [name for name in sorted(self.loaded) if await self._save(name, positions.get(name))]

    async def _save(self, name: str, data_position: DataPosition | None) -> bool:
        entry = self.loaded[name]
        if entry.client or entry.progress in (entry.saved, (0, 0)):
            return False
        if not entry.saves:
            logger.warning("Adapter '%s' has no save directory; its step %d is not saved", name, entry.step)
            return False
        path = await self.backend.save_adapter(SaveRequest(
            name, entry.step, data_position, accumulated_groups=entry.accumulated_groups,
            accumulated_samples=entry.accumulated_groups * entry.samples_per_group,
        ))
        entry.saved = entry.progress
        logger.info("Adapter '%s' saved at step %d (%d group(s) toward the next) to %s", name, entry.step,
                    entry.accumulated_groups, path)
        return True

    async def _data_positions(self) -> dict[str, DataPosition]:
        return await self.rollout_manager.data_positions.remote()
