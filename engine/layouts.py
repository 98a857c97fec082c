"""CPU weight layouts: how a built model's linear weights are stored for this CPU, applied from
outside the model as `parallel.shard` is (engine/device.py `linear_layout` picks one per model):
`packed` (`PackedLinear`) or `bf16-stored` (`Bf16Linear`). Every layout keeps the values and the
`weight`/`bias` names; none changes a product's result beyond BLAS's own summation order.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from engine.device import cpu_linear_kernel
from engine.model import Transformer


def lay_out_linears(model: Transformer, layout: str) -> None:
    """Store `model`'s linear weights as engine/device.py `linear_layout` chose for this device. With
    "bf16-stored" (a float32 model whose weights fit bf16), the embedding table too keeps its rows in
    bf16 when its values fit (always when tied to the LM head), widened to float32 on lookup."""
    if layout == "packed":
        _replace_linears(model, PackedLinear)
    elif layout == "bf16-stored":
        assert model.dtype == torch.float32 and linear_weights_fit_bf16(model), "weights that bf16 would round"
        kernel = cpu_linear_kernel()
        _replace_linears(model, lambda linear: Bf16Linear(linear, kernel))
        table = model.model.embed_tokens.weight
        if _fits_bf16(table):
            model.model.embed_tokens.weight = nn.Parameter(table.detach().bfloat16(), requires_grad=False)
    else:
        assert layout == "as loaded", f"unknown linear layout {layout!r}"


def _replace_linears(model: Transformer, make) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(child))


def linear_weights_fit_bf16(model: Transformer) -> bool:
    """Whether every linear weight is exactly a bf16 value, so storing them as bf16 loses
    nothing (and its shape is one engine/csrc/linear_cpu.cpp takes: out % 8, in % 2)."""
    return all(m.out_features % 8 == 0 and m.in_features % 2 == 0 and _fits_bf16(m.weight)
               for m in model.modules() if isinstance(m, nn.Linear))


class PackedLinear(nn.Module):
    """A frozen nn.Linear with its weight prepacked once in oneDNN's blocked layout (CPU), as
    Inductor's freezing does: few-row products run near the memory floor instead of MKL's small-M
    kernels. Each output row depends only on its input row, not on how many rows share the call. A
    tied LM head gets its own packed copy: the embedding keeps the rows its lookups read."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())  # opaque [out, in]
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        # the bias added apart: the same sum, and a fused bias makes one-row calls slow outside inference mode
        out = torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return out if self.bias is None else out.add_(self.bias)


_scratch = threading.local()  # `scratch`: this thread's buffers, by name


def scratch(name: str, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [n]
    """This thread's buffer `name`, reused by every call (no fresh pages for a large product);
    remade when too small, of another dtype, or made under inference mode and now used outside
    it (where it cannot be written)."""
    buffer = getattr(_scratch, name, None)
    if (buffer is None or buffer.numel() < n or buffer.dtype != dtype
            or (buffer.is_inference() and not torch.is_inference_mode_enabled())):
        buffer = torch.empty(n, dtype=dtype)
        setattr(_scratch, name, buffer)
    return buffer[:n]


def _fits_bf16(t: torch.Tensor) -> bool:
    return torch.equal(t, t.bfloat16().to(t.dtype))


class Bf16Linear(nn.Module):
    """A frozen nn.Linear whose weight holds only bf16 values, stored as bf16 in the blocked layout
    of `kernel` (engine/csrc/linear_cpu.cpp), which widens each weight as it reads it and sums in
    float32, a row's output independent of the rows beside it. Calls of more rows than
    `KERNEL_MAX_ROWS` (prefill chunks, a large packed batch) widen blocks of weights to float32 for
    BLAS, whose sums round differently in the last bits."""

    KERNEL_MAX_ROWS = 128  # the kernel beats BLAS up to about here
    BLOCK_GROUPS = 1024  # groups of 8 weight rows widened at a time for BLAS: a bounded scratch

    def __init__(self, linear: nn.Linear, kernel):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        blocked = kernel.block_weight(linear.weight.detach().bfloat16())  # [out/8, in/2, 8, 2]
        self.weight = nn.Parameter(blocked, requires_grad=False)
        self.bias = linear.bias
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] float32 -> [..., out] float32
        rows = x.reshape(-1, self.in_features)  # [M, in]
        if rows.shape[0] <= self.KERNEL_MAX_ROWS:
            out = self.kernel.bf16_linear(rows.contiguous(), self.weight)
        else:
            blocks = [rows @ self._widened(block) for block in self.weight.split(self.BLOCK_GROUPS)]
            out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out.add_(self.bias)

    def _widened(self, block: torch.Tensor) -> torch.Tensor:  # [in, 8 * groups] float32
        """`block`'s weights as float32, input-major, in this thread's `scratch` (cheap beside the product)."""
        n = block.shape[0] * 8 * self.in_features
        return self.kernel.widen_weight(block, scratch("widened", n).view(self.in_features, -1))
