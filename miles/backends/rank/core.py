"""The training of one rank, the same for every backend: `TrainCore` over a `TrainModel`.

It holds one `SlotAdamW` over the model's LoRA rows and composes the owners of a rank's
work: the loaded adapters (`adapters.py`), loads and cleanups (`loads.py`), train calls
and scorings (`train.py`) with the take-back of a failed call (`take_back.py`), the step
(`step.py`), exports and step checkpoints (`export.py`) and a client's whole state
(`client_state.py`). No Ray, no process group of its own:

    core = TrainCore(config, TorchTrainModel(config), rank=0)
    core.load_adapter(AdapterSpec(name="math", slot=0, rank=8, alpha=16.0, global_batch_size=8))
    core.train(samples, advantages, samples_per_adapter={"math": 8})
    core.step_adapters(["math"])
    # client-driven adapters (Tinker): their datums train in the same micro-batches
    result = core.train_batch(samples, advantages, {"math": 8}, client=[work])   # result.client[0]: DatumOutputs
    core.step_adapters(["sft-1"], adam={"sft-1": AdamStep(learning_rate=1e-4)})
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from miles.backends.base import AdapterSpec, AdapterStepStats, LoadResult
from miles.backends.common.batching import ActivationBudget, Advantage, MicroBatch
from miles.backends.common.checkpoint import AccumulatedGrad, OptimizerState
from miles.backends.common.client_loss import ClientRow
from miles.backends.common.optimizer import SlotAdamW
from miles.backends.rank.adapters import LoadedAdapter, SlotAdapters
from miles.backends.rank.client_state import ClientStates
from miles.backends.rank.config import TrainActorConfig
from miles.backends.rank.export import AdapterExport, GradShare
from miles.backends.rank.loads import AdapterLoads
from miles.backends.rank.model import TrainModel
from miles.backends.rank.step import AdapterSteps
from miles.backends.rank.take_back import TakeBack
from miles.backends.rank.train import BatchTrainer, LossSums, RankTrainResult
from miles.utils.loss_settings import LossSettings
from miles.utils.types import DataPosition, Sample
from miles.utils.types.client import AdamStep, ClientWork


class TrainCore:
    """One rank's training over a `TrainModel`, composed of the owners above; each method is one of theirs."""

    def __init__(self, config: TrainActorConfig, model: TrainModel, rank: int = 0,
                 activation_budget: ActivationBudget | None = None) -> None:
        self.config = config
        self.model = model
        self.rank = rank
        self.optimizer = SlotAdamW(model.lora_params, n_slots=config.n_slots, betas=config.adam_betas,
                                   eps=config.adam_eps)
        self.slots = SlotAdapters(config, model, self.optimizer, rank)
        self.take_back = TakeBack(self.slots, self.optimizer)
        self.loads = AdapterLoads(self.slots, self.take_back)
        self.training = self.build_trainer(activation_budget)
        self.steps = AdapterSteps(self.slots, self.take_back)
        self.export = AdapterExport(self.slots)
        self.client_states = ClientStates(self.slots, self.export, self.take_back)

    def build_trainer(self, activation_budget: ActivationBudget | None) -> BatchTrainer:
        """The owner of train calls; a subclass may return its own."""
        return BatchTrainer(self.slots, self.take_back, activation_budget)

    @property
    def adapters(self) -> dict[str, LoadedAdapter]:
        return self.slots.by_name

    @property
    def activation_budget(self) -> ActivationBudget | None:
        return self.training.activation_budget

    # ---- adapters in slots -------------------------------------------------------------

    def load_adapter(self, spec: AdapterSpec, checkpoint: str | None = None,
                     miles_checkpoint: str | None = None) -> LoadResult:
        return self.loads.load(spec, checkpoint, miles_checkpoint)

    def fresh_export(self, spec: AdapterSpec) -> dict[str, Tensor]:
        return self.loads.fresh_export(spec)

    def cleanup_adapter(self, name: str) -> None:
        self.loads.cleanup(name)

    def loaded_adapters(self) -> dict[str, int]:
        return self.slots.slots()

    def loaded(self, name: str) -> LoadedAdapter:
        return self.slots.loaded(name)

    def loss_settings(self, adapter: str) -> LossSettings:
        return self.slots.loss_settings(adapter)

    def check_rank(self, spec: AdapterSpec) -> None:
        self.slots.check_rank(spec)

    # ---- training ----------------------------------------------------------------------

    def train(
        self, samples: Sequence[Sample], advantages: Sequence[Advantage], samples_per_adapter: dict[str, int]
    ) -> dict[str, LossSums]:
        """`train_batch` of server-driven samples alone; its loss sums."""
        return self.train_batch(samples, advantages, samples_per_adapter).stats

    def train_batch(
        self, samples: Sequence[Sample], advantages: Sequence[Advantage], samples_per_adapter: dict[str, int],
        client: Sequence[ClientWork] = (),
    ) -> RankTrainResult:
        return self.training.train_batch(samples, advantages, samples_per_adapter, client)

    def micro_batches(self, samples: Sequence[Sample], advantages: Sequence[Advantage], *,
                      need_rollout_logprobs: bool = False, max_tokens: int | None = None,
                      client: Sequence[ClientRow] = ()) -> list[MicroBatch]:
        return self.training.micro_batches(samples, advantages, need_rollout_logprobs=need_rollout_logprobs,
                                           max_tokens=max_tokens, client=client)

    def budget_tokens(self, samples: Sequence[Sample], client: Sequence[ClientRow] = ()) -> int | None:
        return self.training.budget_tokens(samples, client)

    def discard_batch(self) -> None:
        """Take back the latest train call (its gradients and LR clock advance), unless an
        adapter stepped since; a failed call does this itself, and `TrainGroup` asks every
        rank when any rank failed, so the batch counts nowhere."""
        self.take_back.discard()

    def step_adapters(self, names: Sequence[str],
                      adam: dict[str, AdamStep] | None = None) -> dict[str, AdapterStepStats]:
        return self.steps.step(names, adam)

    def reward_kl(self, samples: Sequence[Sample]) -> list[list[float]]:
        return self.training.reward_kl(samples)

    def logprobs(self, samples: Sequence[Sample]) -> list[list[float]]:
        return self.training.logprobs(samples)

    # ---- export and checkpoints --------------------------------------------------------

    def export_adapter(self, name: str) -> dict[str, Tensor]:
        return self.export.tensors(name)

    def peft_config(self, spec: AdapterSpec) -> dict[str, Any]:
        return self.slots.peft_config(spec)

    def optimizer_state(self, name: str) -> OptimizerState:
        return self.export.optimizer_state(name)

    def schedule_state(self, name: str) -> dict[str, Any]:
        return self.export.schedule_state(name)

    def accumulated_grad(self, name: str) -> GradShare:
        return self.export.accumulated_grad(name)

    def save_adapter(self, name: str, step: int, data_position: DataPosition | None = None,
                     accumulated: AccumulatedGrad | None = None) -> str:
        return self.export.save(name, step, data_position, accumulated)

    def save_client_state(self, name: str, directory: str, pending: dict[str, Tensor] | None = None) -> str:
        return self.client_states.save(name, directory, pending)

    def load_client_state(self, name: str, directory: str, optimizer: bool = True) -> None:
        self.client_states.load(name, directory, optimizer)
