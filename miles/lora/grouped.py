"""The grouped LoRA linear of a slot-sorted batch as one autograd node.

When a batch is already in the grouped layout (sorted by slot, equal counts, no base-only
rows: `SlotBatch.grouped_in_place`), a LoRA linear is

    out[p] = x[p] @ W^T + scale[p] * (x[p] @ A[p]^T) @ B[p]^T      p = present slot, x[p]: [N, in]

Recorded op by op, autograd keeps about ten nodes per layer (the base matmul, views, two
batched GEMMs, the scale) and the out-of-place add copies the base output. As one
`torch.autograd.Function` the forward is three GEMMs writing into one fresh output, and the
backward five: the base weight is frozen, so it needs no gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


class GroupedLoRALinear(torch.autograd.Function):
    """`apply(x_PNI, weight_OI, bias_O, a_PRI, b_POR, scale_P) -> out_PNO`; `weight_OI` and
    `bias_O` (or None) are frozen: no gradient flows to them."""

    @staticmethod
    def forward(ctx, x_PNI: Tensor, weight_OI: Tensor, bias_O: Tensor | None, a_PRI: Tensor, b_POR: Tensor,
                scale_P: Tensor) -> Tensor:
        out_PNO = F.linear(x_PNI, weight_OI)
        h_PNR = torch.bmm(x_PNI, a_PRI.transpose(1, 2)).mul_(scale_P[:, None, None])
        out_PNO.baddbmm_(h_PNR, b_POR.transpose(1, 2))
        if bias_O is not None:
            out_PNO.add_(bias_O)
        ctx.save_for_backward(x_PNI, weight_OI, a_PRI, b_POR, scale_P, h_PNR)
        return out_PNO

    @staticmethod
    def backward(ctx, grad_PNO: Tensor):
        x_PNI, weight_OI, a_PRI, b_POR, scale_P, h_PNR = ctx.saved_tensors
        needs_x, _, _, needs_a, needs_b, _ = ctx.needs_input_grad
        grad_x = grad_a = grad_b = None
        grad_h_PNR = torch.bmm(grad_PNO, b_POR).mul_(scale_P[:, None, None])
        if needs_x:
            grad_x = torch.matmul(grad_PNO, weight_OI).baddbmm_(grad_h_PNR, a_PRI)
        # A and B's gradients as x^T grad_h and h^T grad, transposed: the products autograd
        # forms for the op-by-op path, so both paths round alike.
        if needs_a:
            grad_a = torch.bmm(x_PNI.transpose(1, 2), grad_h_PNR).transpose(1, 2)
        if needs_b:
            grad_b = torch.bmm(h_PNR.transpose(1, 2), grad_PNO).transpose(1, 2)
        return grad_x, None, None, grad_a, grad_b, None
