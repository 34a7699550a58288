"""The control plane's HTTP bodies: a registration, an adapter's status and why it failed."""

from __future__ import annotations

import enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from miles.utils.types.client_commands import AdapterKind
from miles.utils.types.lifecycle import AdapterState

MAX_PRIORITY = 1_000_000
"""A registration's `priority` lies in -MAX_PRIORITY..MAX_PRIORITY."""


class RegisterAdapterRequest(BaseModel):
    """`POST /adapter_runs`: exactly one of `config` (inline fields) or `yaml_path`, and an
    optional queue `priority`."""

    model_config = ConfigDict(extra="forbid")

    name: str
    config: dict[str, Any] | None = None
    yaml_path: str | None = None
    priority: StrictInt = Field(default=0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    """Only matters when every slot is held: the registration is QUEUED, and the queue hands
    free slots to higher priorities first (equal ones in arrival order). A whole number."""


class RegisterAdapterResponse(BaseModel):
    """The answer to `POST /adapter_runs`."""

    name: str
    slot: int | None
    """The slot it was given (PENDING), or None when it was QUEUED."""
    state: AdapterState
    """PENDING, or QUEUED when every slot was held."""
    queue_position: int | None = None
    """QUEUED only: 1 is the head of the queue (the next slot that frees is its)."""


MAX_ERROR_TYPE_CHARS = 200
MAX_ERROR_MESSAGE_CHARS = 1000
"""A failure's type and message are cut to these lengths (a plug-in's message may be huge)."""


class FailureReason(str, enum.Enum):
    """Why the producer gave up on an adapter."""

    ERRORS = "errors"
    """Its prompt groups raised, group after group (its reward, generate function, dynamic
    filter or prompt rendering), `--multi-lora-max-consecutive-failures` times in a row."""
    FILTERED = "filtered"
    """Its dynamic filter dropped every group, `--multi-lora-max-consecutive-filtered` in a row."""


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


class AdapterFailure(BaseModel):
    """An adapter's `last_error`: why it was FAILED, bounded so a status stays small.

    >>> AdapterFailure.from_exception(ValueError("reward server said 500"), groups=32).message
    'reward server said 500'
    """

    model_config = ConfigDict(frozen=True)

    reason: FailureReason
    error_type: str | None
    """The exception's class (module-qualified unless a builtin) of the last failed group;
    None when the groups were filtered, not failed."""
    message: str
    """The last error's message (or, when filtered, what the filter dropped), at most
    `MAX_ERROR_MESSAGE_CHARS` characters."""
    groups: int
    """Prompt groups that failed (or were dropped) in a row, since its last kept group."""

    @field_validator("error_type")
    @classmethod
    def _bound_type(cls, value: str | None) -> str | None:
        return None if value is None else _cut(value, MAX_ERROR_TYPE_CHARS)

    @field_validator("message")
    @classmethod
    def _bound_message(cls, value: str) -> str:
        return _cut(value, MAX_ERROR_MESSAGE_CHARS)

    @classmethod
    def from_exception(cls, exc: BaseException, groups: int) -> AdapterFailure:
        kind = type(exc)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        return cls(reason=FailureReason.ERRORS, error_type=name, message=str(exc) or repr(exc), groups=groups)

    def summary(self) -> str:
        """One line: `ValueError: boom (32 groups in a row)`."""
        head = f"{self.error_type}: " if self.error_type else ""
        return f"{head}{self.message} ({self.groups} groups in a row)"


class AdapterStatus(BaseModel):
    """One adapter as the control plane reports it: its run, its config fields, its state.

    A client-driven adapter (`kind` "client", a Tinker model) has no dataset, reward,
    batch or schedule: those fields are None for it, and `model_id` names it to its client."""

    name: str
    state: AdapterState
    slot: int | None
    """The slot it holds, or held last once COMPLETED; None while QUEUED."""
    version: int | None
    """Slot version; None once COMPLETED (the slot may serve another adapter)."""
    step: int
    accumulated_groups: int
    registration_id: str
    kind: AdapterKind = AdapterKind.SERVER
    queue_position: int | None = None
    """QUEUED only: its place in the registration queue, 1 for the head (the next slot that
    frees is its); None in every other state."""
    priority: int = 0
    """The priority it was registered with (the queue's order: higher first, then arrival)."""
    last_error: AdapterFailure | None = None
    """Why it failed: set when the producer gave up on it (it then leaves through CLEANUP
    and ends FAILED); None otherwise."""
    data: str | None = None
    rank: int
    alpha: float
    rollout_batch_size: int | None = None
    n_samples_per_prompt: int | None = None
    save: str
    input_key: str | None = None
    label_key: str | None = None
    """None: the adapter's rows carry no label."""
    metadata_key: str | None = None
    rm_type: str | None = None
    custom_rm_path: str | None = None
    custom_generate_function_path: str | None = None
    dynamic_sampling_filter_path: str | None = None
    num_step: int | None = None
    num_epoch: int | None = None
    metadata: dict[str, Any] = {}
    lr: float | None = None
    weight_decay: float | None = None
    lr_decay_style: str | None = None
    lr_warmup_steps: int | None = None
    loss: dict[str, Any] | None = None
    """Every loss flag of the adapter, by Miles' flag name."""
    model_id: str | None = None
    """Client-driven only: the Tinker model id."""
    seed: int | None = None
    """Client-driven only: the LoRA init seed the client asked for."""
    train_attn: bool | None = None
    """Client-driven only: its layout (`create_model`'s lora_config): attention LoRA trains."""
    train_mlp: bool | None = None
    """Client-driven only: MLP LoRA trains."""
    train_unembed: bool | None = None
    """Client-driven only: unembedding (lm_head) LoRA trains."""
