"""GGUF quantized weights kept as they are in the file (CPU): `QuantLinear` multiplies activations
with the file's blocks in engine/csrc/quant_cpu.cpp (its opening comment describes its paths per
CPU), each weight unpacked in registers to exactly the float32 value gguf's dequantize gives: the
model in the file, with no dequantized copy. engine/loading.py reads a .gguf into these modules.
`quick_view(model)` is the one lossy path, for a middle level: the same blocks with int8
activations; the model itself stays exact. Nothing here quantizes anything.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch
import torch.nn as nn

from engine.device import build_cpu_extension
from engine.layouts import scratch

# ggml type ids the kernel reads; others (and F16 / BF16) are dequantized to float32 at load
KERNEL_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
INTERLEAVED_TYPES = (6, 12, 14)  # Q5_0, Q4_K, Q6_K: a bf16 model decodes them from 16 interleaved rows
# F16C for the block scales; no contraction, so d * q - m rounds as numpy's two operations do
CFLAGS = ("-mf16c", "-ffp-contract=off")


@functools.cache
def cpu_quant_kernel():
    """engine/csrc/quant_cpu.cpp, or None (no AVX2 / compiler): GGUFs then load dequantized."""
    return build_cpu_extension("bookchat_quant_cpu", Path(__file__).parent / "csrc" / "quant_cpu.cpp",
                               "GGUF weights are dequantized at load", extra_cflags=CFLAGS)


class QuantLinear(nn.Module):
    """A frozen linear whose weight is the file's blocks, `weight` [out, row bytes] uint8 of ggml type
    `qtype`. Calls of at most `KERNEL_MAX_ROWS` rows run the kernel in float32, a row's output
    independent of the rows beside it. Larger calls (prefill chunks) dequantize `BLOCK_ROWS` weight
    rows at a time to the activations' dtype for a GEMM: another precision than decoding, but the same
    prefill for plain and speculative decoding, so every stack still gives plain decoding's tokens."""

    KERNEL_MAX_ROWS = 128
    BLOCK_ROWS = 4096  # weight rows dequantized at a time for the GEMM (16 MB float32 at in = 896)

    def __init__(self, blocks: torch.Tensor, qtype: int, in_features: int, bias: torch.Tensor | None, kernel,
                 out_dtype: torch.dtype | None = None):
        super().__init__()
        assert blocks.dtype == torch.uint8 and blocks.dim() == 2, "GGUF blocks [out, row bytes]"
        assert qtype in KERNEL_TYPES, f"ggml type {qtype} is not one the kernel reads"
        self.in_features, self.out_features, self.qtype = in_features, blocks.shape[0], qtype
        self.weight = nn.Parameter(blocks, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.kernel, self.out_dtype = kernel, out_dtype
        self.lossy = False  # calls of at most KERNEL_MAX_ROWS rows run `quick_linear` (see `quick`)
        self._interleaved: torch.Tensor | None = None  # made at the first call that reads it

    def has_quick_path(self) -> bool:
        return self.kernel.quick_supports(self.qtype, self.in_features)

    def quick(self) -> QuantLinear:
        """A twin over the same blocks and bias (no copy) whose few-row calls run quant_cpu.cpp
        `quick_linear` (activations rounded to int8 per 32 values): lossy, for a middle level only.
        Exact where the kernel has no quick path (Q4_1); prefill-size calls keep the GEMM either way."""
        twin = QuantLinear(self.weight, self.qtype, self.in_features, self.bias, self.kernel, self.out_dtype)
        twin.lossy = self.has_quick_path()
        twin._interleaved = self._interleaved  # an exact twin decodes from the same copy, not its own
        return twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] float32 / bf16 -> [..., out]
        rows = x.reshape(-1, self.in_features)  # [M, in]
        rows = rows if rows.dtype == torch.bfloat16 else rows.float()  # bf16 rows stay bf16 on every path
        out_dtype = self.out_dtype or x.dtype
        is_few_rows = rows.shape[0] <= self.KERNEL_MAX_ROWS
        if is_few_rows and not self.lossy:  # the kernel's BF16 dot products, or widened in it; its
            # epilogue adds the bias and rounds to bf16 as add_ and .to would
            out = self.kernel.quant_linear(rows.contiguous(), self.weight, self.qtype, self.bias,
                                           out_dtype == torch.bfloat16, self.interleaved(rows.dtype))
        else:
            if is_few_rows:
                out = self.kernel.quick_linear(rows.float().contiguous(), self.weight, self.qtype)
            else:
                blocks = [rows @ self._dequantized(block, rows.dtype).t()
                          for block in self.weight.split(self.BLOCK_ROWS)]
                out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
            if self.bias is not None:
                out.add_(self.bias)
        return out.to(out_dtype).view(*x.shape[:-1], self.out_features)

    def interleaved(self, dtype: torch.dtype) -> torch.Tensor | None:
        """For bf16 activations where the kernel has BF16 dot products, Q5_0's, Q4_K's or Q6_K's blocks
        with 16 weight rows interleaved (quant_cpu.cpp `interleave`): a copy made at the first call."""
        if dtype != torch.bfloat16 or self.qtype not in INTERLEAVED_TYPES or not self.kernel.uses_bf16_dots():
            return None
        if self._interleaved is None:  # the blocks are frozen: one copy serves every call
            self._interleaved = self.kernel.interleave(self.weight, self.qtype, self.in_features)
        return self._interleaved

    def dequantized(self) -> torch.Tensor:  # [out, in] float32, a fresh tensor
        return self.kernel.dequantize(self.weight, self.qtype, torch.empty(self.out_features, self.in_features))

    def _dequantized(self, block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [rows, in], in scratch
        """float32, or bf16 as `.to(torch.bfloat16)` rounds them, written straight by the kernel."""
        tile = scratch(f"dequantized {dtype}", block.shape[0] * self.in_features, dtype).view(-1, self.in_features)
        return self.kernel.dequantize(block, self.qtype, tile)

    def extra_repr(self) -> str:
        lossy = ", quick (int8 activations)" if self.lossy else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {KERNEL_TYPES[self.qtype]}{lossy}"


class QuantEmbedding(nn.Module):
    """A token embedding whose table is the file's blocks: looked-up rows are dequantized."""

    def __init__(self, blocks: torch.Tensor, qtype: int, dim: int, kernel):
        super().__init__()
        self.weight = nn.Parameter(blocks, requires_grad=False)  # [V, row bytes] uint8
        self.qtype, self.dim, self.kernel = qtype, dim, kernel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, dim] float32
        rows = self.weight.index_select(0, ids.reshape(-1))
        out = self.kernel.dequantize(rows, self.qtype, torch.empty(rows.shape[0], self.dim))
        return out.view(*ids.shape, self.dim)


def is_quantized(model: nn.Module) -> bool:
    """Whether `model` holds GGUF blocks: its layout is then the file's, never changed after."""
    return any(isinstance(m, QuantLinear | QuantEmbedding) for m in model.modules())


def quick_view(model: nn.Module) -> nn.Module:
    """A second model object over the same tensors whose `QuantLinear`s are their lossy twins
    (`QuantLinear.quick`), for a middle level; `model` itself when no linear has a quick path. Every
    module is a shallow copy (its own child, parameter and buffer dicts), so the view can take its
    own attention and `model` stays exact."""
    if not any(isinstance(m, QuantLinear) and m.has_quick_path() for m in model.modules()):
        return model

    def view(module: nn.Module) -> nn.Module:
        if isinstance(module, QuantLinear):
            return module.quick()
        twin = copy.copy(module)
        twin._parameters, twin._buffers = dict(module._parameters), dict(module._buffers)
        twin._modules = {name: None if child is None else view(child) for name, child in module._modules.items()}
        return twin

    return view(model)
