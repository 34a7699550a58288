"""The five places where megatron-core 0.16.1 assumes CUDA, worked around for CPU runs.

The Megatron backend runs on CPU over gloo so CI can check it against the torch
backend. `apply_cpu_shims()` is called once per process before a model is built and
does nothing when CUDA is available: on GPUs megatron-core runs as shipped.

1. RoPE: `RotaryEmbedding.get_emb` moves `inv_freq` to `torch.cuda.current_device()`
   on its first call (megatron/core/models/common/embeddings/rotary_pos_embedding.py,
   `if self.inv_freq.device.type == 'cpu': self.inv_freq = self.inv_freq.to(...)`).
   The shim computes the same embedding where `inv_freq` already lives.
2. Causal mask: `GPTModel`'s attention builds its default causal mask on "cuda" when no
   mask is given. Not patched: `miles.backends.megatron.model.causal_mask` is always
   passed explicitly.
3. RNG tracker: `CudaRNGStatesTracker.fork()` (megatron/core/tensor_parallel/random.py)
   saves and restores CUDA RNG states around dropout. The shim initialises the tracker
   with megatron-core's own `inference_rng_tracker=True` variant, whose `fork()` is a
   no-op; dropout is 0 in this backend, so no random numbers are drawn inside it.
4. Attention scores buffer: `GlobalMemoryBuffer.get_tensor` (megatron/core/utils.py,
   `torch.empty(..., device=torch.cuda.current_device())`), used by the local
   `DotProductAttention` for `baddbmm(..., beta=0)`. The shim allocates on the CPU.
5. Activation recomputation: `tensor_parallel.checkpoint` (`CheckpointFunction`, used by
   `--recompute-granularity full` and `selective`) saves the CPU and CUDA RNG states and
   the tracker's at the forward and sets them again around the recomputed forward
   (`_get_all_rng_states` / `_set_all_rng_states` through `_get_cuda_rng_state` and
   `_set_cuda_rng_state`, megatron/core/tensor_parallel/random.py). The shim makes those
   two hold no CUDA state: the CUDA getter returns None and the setter ignores it. The CPU
   RNG state is still saved and restored, and the tracker's (empty, see 3) as shipped;
   dropout is 0, so no random number is drawn in a recomputed layer anyway.
"""

from __future__ import annotations

import torch

_applied = False


def cuda_available() -> bool:
    return torch.cuda.is_available()


def apply_cpu_shims() -> None:
    """Patch megatron-core for CPU (idempotent; a no-op when CUDA is available)."""
    global _applied
    if _applied or cuda_available():
        return
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.utils import GlobalMemoryBuffer

    RotaryEmbedding.get_emb = _get_emb_on_inv_freq_device
    GlobalMemoryBuffer.get_tensor = _cpu_buffer_tensor
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    tp_random._get_cuda_rng_state = _no_cuda_rng_state
    tp_random._set_cuda_rng_state = _ignore_cuda_rng_state
    _applied = True


def _get_emb_on_inv_freq_device(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """`RotaryEmbedding.get_emb` without the move of `inv_freq` to the current CUDA device."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def _cpu_buffer_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None) -> torch.Tensor:
    """`GlobalMemoryBuffer.get_tensor` with the buffer kept on the CPU."""
    required = 1
    for n in tensor_shape:
        required *= n
    key = (name, dtype)
    if self.buffer.get(key) is None or self.buffer[key].numel() < required:
        self.buffer[key] = torch.empty(required, dtype=dtype, requires_grad=False)
    return self.buffer[key][:required].view(*tensor_shape)


def _no_cuda_rng_state(device=None, clone: bool = False, graph_safe: bool = False) -> None:
    """`_get_cuda_rng_state` without a CUDA generator: there is no state to save."""
    return None


def _ignore_cuda_rng_state(new_state, device: int = -1, graph_safe: bool = False) -> None:
    """`_set_cuda_rng_state` without a CUDA generator (the state is `_no_cuda_rng_state`'s None)."""
