"""The loop's stages over one training backend, controller and rollout manager.

    stages = Stages.build(backend, controller, rollout_manager, pusher=pusher, save_interval=1)
    snapshot = await stages.slots.reconcile(snapshot)

One object per stage of the loop (README "How it fits together"), each the only owner of
what it does: `AdapterSlots` (reconcile and saves), `WeightPush` (the push to the engines,
its versions and overlap), `EarlyActivation` (registrations pushed during an iteration),
`TrainStep` (train and commit) and `ClientCommands` (the Tinker clients' commands).
"""

from __future__ import annotations

from dataclasses import dataclass

from miles.backends.base import TrainingBackend
from miles.main.adapter_slots import AdapterSlots
from miles.main.client_commands import ClientCommands
from miles.main.early_activation import EarlyActivation
from miles.main.handles import ControllerHandle, RolloutManagerHandle
from miles.main.train_step import TrainStep
from miles.main.weight_push import Pusher, WeightPush


@dataclass
class Stages:
    slots: AdapterSlots
    push: WeightPush
    activation: EarlyActivation
    train: TrainStep
    clients: ClientCommands

    @classmethod
    def build(cls, backend: TrainingBackend, controller: ControllerHandle, rollout_manager: RolloutManagerHandle, *,
              pusher: Pusher | None = None, save_interval: int | None = None, overlap_push: bool = False,
              max_train_failures: int = 3, client_wait_s: float = 1.0, idle_evict_s: float = 0.0) -> Stages:
        push = WeightPush(backend, controller, pusher, overlap=overlap_push)
        activation = EarlyActivation(backend, controller, push, loaded=lambda: slots.loaded)
        slots = AdapterSlots(backend, controller, rollout_manager, push, activation, save_interval=save_interval,
                             idle_evict_s=idle_evict_s)
        train = TrainStep(backend, controller, push, max_failures=max_train_failures)
        clients = ClientCommands(backend, controller, loaded=lambda: slots.loaded_clients(), wait_s=client_wait_s)
        return cls(slots, push, activation, train, clients)
