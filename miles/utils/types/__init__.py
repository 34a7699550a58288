"""The types that cross a process or component boundary, defined once, by topic.

Controller snapshots travel from the controller actor to the driver (`lifecycle`), the
control plane's bodies over HTTP (`control_plane`), samples and rollout batches from the
rollout manager to the train actors (`rollout`), pushed LoRA weights to the engines
(`pushes`), engine requests and answers over HTTP (`engine_api`), and a Tinker client's
datums and optimizer settings from the gateway to the train ranks (`client`), and its
models and command log from the controller to the driver (`client_commands`). Everything is a
plain dataclass (picklable by Ray) or a pydantic model (validated at the HTTP edge);
nothing is a string-keyed dict. Import from this package: `from miles.utils.types import Sample`.
"""

from miles.utils.types.client import (
    CLIENT_LOSSES,
    AdamStep,
    ClientDatum,
    ClientLoss,
    ClientLossName,
    ClientWork,
    DatumOutput,
)
from miles.utils.types.client_commands import (
    AdapterKind,
    ClientAdapterRun,
    ClientCommand,
    ClientCommandBatch,
    ClientCommandKind,
    ClientCommandStatus,
    ClientModelConfig,
    ClientRequest,
    ClientResult,
    ForwardBackwardResult,
    ForwardCommand,
    LoadStateCommand,
    ModelCommands,
    OptimStepCommand,
    OptimStepResult,
    SaveForSamplerCommand,
    SaveStateCommand,
    WeightsResult,
)
from miles.utils.types.control_plane import (
    AdapterStatus,
    RegisterAdapterRequest,
)
from miles.utils.types.engine_api import (
    AbortRequest,
    DestroyWeightsUpdateGroupRequest,
    FinishReason,
    GenerateMetaInfo,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    LoadLoraFromDistributedRequest,
    LoadLoraRequest,
    SamplingParams,
    UnloadLoraRequest,
)
from miles.utils.types.lifecycle import (
    ENGINE_LORA_PREFIX,
    AdapterRun,
    AdapterState,
    LoraUpdateMode,
    MultiLoRASnapshot,
    adapter_rid,
    adapter_rid_prefix,
    engine_lora_name,
    engine_lora_slot,
    next_slot_version,
)
from miles.utils.types.pushes import (
    SlotPush,
    UpdateGroupLayout,
)
from miles.utils.types.rollout import (
    AdapterGauges,
    AdapterRolloutStats,
    DataPosition,
    DropReason,
    GenerationCounts,
    PromptGroup,
    RolloutBatch,
    RolloutStats,
    Sample,
    SampleStatus,
)

__all__ = [
    "CLIENT_LOSSES",
    "AdamStep",
    "ClientDatum",
    "ClientLoss",
    "ClientLossName",
    "ClientWork",
    "DatumOutput",
    "AdapterKind",
    "ClientAdapterRun",
    "ClientCommand",
    "ClientCommandBatch",
    "ClientCommandKind",
    "ClientCommandStatus",
    "ClientModelConfig",
    "ClientRequest",
    "ClientResult",
    "ForwardBackwardResult",
    "ForwardCommand",
    "LoadStateCommand",
    "ModelCommands",
    "OptimStepCommand",
    "OptimStepResult",
    "SaveForSamplerCommand",
    "SaveStateCommand",
    "WeightsResult",
    "AbortRequest",
    "AdapterGauges",
    "AdapterRolloutStats",
    "AdapterRun",
    "AdapterState",
    "AdapterStatus",
    "DataPosition",
    "DestroyWeightsUpdateGroupRequest",
    "DropReason",
    "ENGINE_LORA_PREFIX",
    "FinishReason",
    "GenerateMetaInfo",
    "GenerateRequest",
    "GenerateResponse",
    "GenerationCounts",
    "InitWeightsUpdateGroupRequest",
    "LoadLoraFromDistributedRequest",
    "LoadLoraRequest",
    "LoraUpdateMode",
    "MultiLoRASnapshot",
    "PromptGroup",
    "RegisterAdapterRequest",
    "RolloutBatch",
    "RolloutStats",
    "Sample",
    "SampleStatus",
    "SamplingParams",
    "SlotPush",
    "UnloadLoraRequest",
    "UpdateGroupLayout",
    "adapter_rid",
    "adapter_rid_prefix",
    "engine_lora_name",
    "engine_lora_slot",
    "next_slot_version",
]
