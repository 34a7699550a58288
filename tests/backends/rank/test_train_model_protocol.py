"""Both backends' models implement the whole `TrainModel` protocol the core drives.

The torch model is built on the tiny model; the Megatron model needs megatron-core's
process groups to be built, so its class is checked (every method, and the flags that
are properties of its rank); `tests/backends/megatron` runs it through the core.
"""

from __future__ import annotations

import inspect
from typing import get_type_hints

from miles.backends.megatron.train_model import MegatronTrainModel
from miles.backends.rank.config import TrainActorConfig
from miles.backends.rank.model import TrainModel
from miles.backends.torch.train_model import TorchTrainModel

METHODS = sorted(name for name, member in vars(TrainModel).items()
                 if inspect.isfunction(member) and not name.startswith("_"))
ATTRIBUTES = sorted({*get_type_hints(TrainModel),
                     *(name for name, member in vars(TrainModel).items() if isinstance(member, property))})
"""Its attributes and its read-only properties (the rank's flags)."""


def test_the_protocol_names_what_the_core_uses():
    assert "forward_logprobs" in METHODS and "pad_slot_tensors" in METHODS
    assert {"lora_params", "dp_rank", "writes", "slot_grad_norm"} <= set(ATTRIBUTES)


def test_the_torch_model_has_every_member(tiny_model_dir):
    model = TorchTrainModel(TrainActorConfig(hf_checkpoint=str(tiny_model_dir), n_slots=2, lora_rank=4))
    missing = [name for name in METHODS + ATTRIBUTES if not hasattr(model, name)]
    assert not missing
    assert len(model.param_names) == len(model.lora_params) > 0
    assert model.reports_loss and model.gathers and model.writes and model.slot_grad_norm is None


def test_the_megatron_model_has_every_method_and_its_rank_decides_the_flags():
    missing = [name for name in METHODS + ["slot_grad_norm"] if not callable(getattr(MegatronTrainModel, name, None))]
    assert not missing

    def flags(rank: int, tp_size: int) -> tuple:
        model = MegatronTrainModel.__new__(MegatronTrainModel)  # no model: the flags read rank and TP size only
        model.rank, model.tp_size = rank, tp_size
        return model.dp_rank, model.reports_loss, model.gathers, model.writes

    assert flags(0, 2) == (0, True, True, True)
    assert flags(1, 2) == (0, False, True, False)  # TP rank 1 of replica 0: gathers, neither reports nor writes
    assert flags(2, 2) == (1, True, False, False)  # TP rank 0 of replica 1: reports its replica's loss only
