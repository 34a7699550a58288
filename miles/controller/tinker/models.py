"""Tinker models as client-driven adapters: a model id's registry name, the validation of its
LoRA layout against the slots, its registration and its unload.

A model is an adapter of kind CLIENT in the same registry and slots as the RL adapters,
named after its model id (`{session}:train:{n}` -> `{session}.train.{n}`, since adapter
names take no ':'); unloading deregisters it and the normal lifecycle frees its slot.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles.controller.backend import MultiLoRABackend
from miles.controller.registry import AdapterValidationError, NoFreeSlotError
from miles.controller.tinker.command_log import CommandLog
from miles.controller.tinker.errors import GatewayCapacityError, GatewayError, GatewayNotFoundError
from miles.controller.tinker.sessions import Session, Sessions
from miles.utils.types import AdapterKind, AdapterState, ClientModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoraLayout:
    """`create_model`'s LoRA config, by the SDK's field names."""

    rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


def model_name(model_id: str) -> str:
    """The registry name of a model id (adapter names take no ':')."""
    return model_id.replace(":", ".")


class Models:
    """Every model id the registry knows (live or completed) and its adapter's name."""

    def __init__(self, backend: MultiLoRABackend, sessions: Sessions, log: CommandLog, *,
                 base_model: str | None = None, target_modules: str = "all-linear",
                 lora_unembed: bool = False) -> None:
        self.backend = backend
        self.sessions = sessions
        self.log = log
        self.base_model = base_model
        """The base model served (as clients name it); None accepts any name."""
        self.target_modules = target_modules
        self.lora_unembed = lora_unembed
        self._models: dict[str, str] = {}
        """model id -> registry name, for every client-driven adapter the registry knows."""
        for status in backend.statuses():
            if status.kind is AdapterKind.CLIENT and status.model_id is not None:
                self._models[status.model_id] = status.name

    def get(self, model_id: str) -> tuple[str, ClientModelConfig]:
        """A known model's registry name and config (live or completed)."""
        name = self._models.get(model_id)
        config = None if name is None else self.backend.registry.client_config(name)
        if name is None or config is None:
            raise GatewayNotFoundError(f"Unknown model {model_id!r}; create it with create_model")
        return name, config

    def name(self, model_id: str) -> str | None:
        return self._models.get(model_id)

    def names(self) -> list[str]:
        return list(self._models.values())

    def state(self, model_id: str) -> AdapterState | None:
        name, _ = self.get(model_id)
        return self.backend.registry.state(name)

    def training_runs(self) -> list[str]:
        """Every model id this trainer knows (live or unloaded), newest first."""
        return list(reversed(self._models))

    def last_request_time(self, model_id: str) -> float:
        """When the model's session was last heard from (a restart counts as now)."""
        _, config = self.get(model_id)
        return self.sessions.get(config.session_id).last_heartbeat

    def runnable(self, loaded: Collection[str] | None = None) -> dict[str, tuple[int, str]]:
        """Live client-driven adapters that may run commands: name -> (slot, registration id);
        only those of `loaded` (the ones the trainer holds in their slots) when given."""
        return {name: (run.slot, run.registration_id) for name, run in self.backend.snapshot().clients.items()
                if run.state in (AdapterState.PENDING, AdapterState.ACTIVE) and (loaded is None or name in loaded)}

    def served_base_model(self, base_model: str) -> str:
        served = self.base_model
        if served is not None and base_model not in (served, Path(served).name):
            raise GatewayError(f"base_model {base_model!r} is not served here; this trainer serves {served!r}")
        return base_model

    def new_model_id(self, session: Session, model_seq_id: int) -> str:
        if session.finished:
            raise GatewayError(f"Session {session.session_id} is finished; create a new ServiceClient")
        if model_seq_id < 0:
            raise GatewayError(f"model_seq_id must be >= 0, got {model_seq_id}")
        model_id = f"{session.session_id}:train:{model_seq_id}"
        if model_id in self._models:
            raise GatewayError(f"Model {model_id} already exists; use the next model_seq_id")
        return model_id

    def config(self, model_id: str, session_id: str, base_model: str, lora: LoraLayout | None,
               user_metadata: dict[str, Any]) -> ClientModelConfig:
        """The model's adapter config, its layout checked against what the slots carry."""
        self.served_base_model(base_model)
        if lora is None:
            raise GatewayError("lora_config is required: this trainer trains LoRA adapters only")
        defaults = self.backend.defaults
        if lora.rank <= 0 or lora.rank > defaults.lora_rank:
            raise GatewayError(f"lora_config.rank {lora.rank} must be in 1..{defaults.lora_rank} "
                               f"(the slot width, --lora-rank); lower rank")
        if self.target_modules.strip() != "all-linear":
            raise GatewayError(f"this trainer's slots cover only --target-modules {self.target_modules!r}, "
                               "not a Tinker layout (train_mlp/train_attn); restart it with "
                               "--target-modules all-linear")
        if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
            raise GatewayError("lora_config trains nothing: train_mlp, train_attn and train_unembed are all False; "
                               "set at least one")
        if lora.train_unembed and not self.lora_unembed:
            raise GatewayError("lora_config.train_unembed=True needs LoRA on the unembedding (lm_head), which this "
                               "trainer's slots do not carry: restart it with --lora-unembed, or pass "
                               "train_unembed=False")
        if defaults.save is None:
            raise GatewayError("this trainer has no --save directory, so a model could not save its state; "
                               "restart it with --save")
        save = (Path(defaults.save).expanduser() / "adapters" / model_name(model_id)).resolve()
        return ClientModelConfig(model_id=model_id, session_id=session_id, base_model=base_model, rank=lora.rank,
                                 alpha=defaults.lora_alpha, seed=lora.seed, save=save, user_metadata=user_metadata,
                                 train_mlp=lora.train_mlp, train_attn=lora.train_attn,
                                 train_unembed=lora.train_unembed)

    def register(self, session: Session, config: ClientModelConfig) -> str:
        """Register the model's adapter (PENDING in the lowest free slot); returns its name."""
        model_id = config.model_id
        name = model_name(model_id)
        try:
            self.backend.register_client(name, config)
        except NoFreeSlotError as exc:
            raise GatewayCapacityError(str(exc)) from None
        except AdapterValidationError as exc:
            raise GatewayError(str(exc)) from None
        self._models[model_id] = name
        self.sessions.add_model(session, model_id)
        logger.info("Tinker model %s created: adapter '%s', rank %d", model_id, name, config.rank)
        return name

    def unload(self, model_id: str) -> bool:
        """Deregister a live (or paged) model; its unrun commands fail. False: it was not live."""
        name = self._models.get(model_id)
        if name is None or self.backend.registry.state(name) not in (AdapterState.PENDING, AdapterState.ACTIVE,
                                                                      AdapterState.PAGED):
            return False
        self.backend.deregister(name)
        failed = self.log.fail_model(name, f"model {model_id} was unloaded before this command ran")
        logger.info("Tinker model %s unloaded (%d queued commands failed)", model_id, len(failed))
        return True
