"""GGUF quantized weights kept as they are in the file: a model's linears multiply float32
activations (a bf16 model's, widened) with the file's blocks (engine/csrc/quant_cpu.cpp), each
weight unpacked in registers to exactly the float32 value gguf's dequantize gives. The linears
are "the model in the file", dequantized in float32, with no dequantized copy on disk and about
a quarter of bf16's bytes read per token. On AVX2 without AVX-512, Q4_K's linears take each
sub-block's scale out of its sum (x times the codes, summed, then scaled once): the same real
sum in another float32 grouping, one FMA per 8 weights instead of two. On CPUs with AVX512-BF16
a bf16 model's Q4_K and Q6_K linears multiply the bf16 activations with the integer codes in
exact bf16 products and apply each group's float32 scale to the group's sum: the same exact
products, summed in float32 in another grouping, in less time; decoding reads them (and Q5_0)
from a copy with 16 weight rows interleaved (`QuantLinear.interleaved`), one scale per 16 rows,
which reads the weights at about the memory's speed at 2 threads (benchmarks/RESULTS.md).

This module holds the modules and the kernel; engine/loading.py `load_quantized_model` reads a
.gguf into them and `load_model` chooses when. Nothing here quantizes anything.

`quick_view(model)` is the exception, for a middle level: the same blocks multiplied with int8
activations (quant_cpu.cpp `quick_linear`), cheaper and lossy; the model itself stays exact.
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
_SOURCE = Path(__file__).parent / "csrc" / "quant_cpu.cpp"
# F16C for the block scales; no contraction, so d * q - m rounds as numpy's two operations do
CFLAGS = ("-mf16c", "-ffp-contract=off")


@functools.cache
def cpu_quant_kernel():
    """engine/csrc/quant_cpu.cpp, or None (no AVX2 / compiler): GGUFs then load dequantized."""
    return build_cpu_extension("bookchat_quant_cpu", _SOURCE, "GGUF weights are dequantized at load",
                               extra_cflags=CFLAGS)


class QuantLinear(nn.Module):
    """A frozen linear whose weight is the file's blocks, `weight` [out, row bytes] uint8 of ggml
    type `qtype`. Calls of at most `KERNEL_MAX_ROWS` rows run the kernel in float32 (a bf16
    model's activations are widened, exactly, or taken as bf16 by the kernel's BF16 dot products
    where it has them: exact products too), whose output rows do not depend on the rows beside
    them; the bias (float32, as in the file) is added in float32, and the sum is returned in
    `out_dtype`, else in the activations' dtype. Larger calls (prefill chunks) dequantize
    `BLOCK_ROWS` weight rows at a time to the activations' dtype (bf16 or float32) for a GEMM,
    summed in another order and, in a bf16 model, in bf16 products: the prefill then computes in
    another precision than decoding does, the same prefill for plain and speculative decoding,
    so losslessness (every stack gives plain decoding's tokens) is untouched. Where the CPU has
    bf16 instructions the bf16 GEMM is the faster one (benchmarks/history/2026-11-results.md,
    "Prefill attention in BF16 dot products")."""

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
        self._interleaved: tuple[tuple, torch.Tensor] | None = None  # (the weight it was made from, it)

    def has_quick_path(self) -> bool:
        return self.kernel.quick_supports(self.qtype, self.in_features)

    def quick(self) -> QuantLinear:
        """A twin over the same blocks and bias (no copy) whose calls of at most KERNEL_MAX_ROWS
        rows run quant_cpu.cpp `quick_linear`: activations rounded to int8 per 32 values and
        integer dot products: a small relative error on real activations, and faster, most at
        one row (`python -m benchmarks.kernels --only quick`; history, "Int8 drafts"). Lossy:
        for a middle level only. Where the
        kernel has no quick path for this type (Q4_1) the twin is exact; prefill-size calls keep
        the dequantizing GEMM either way."""
        twin = QuantLinear(self.weight, self.qtype, self.in_features, self.bias, self.kernel, self.out_dtype)
        twin.lossy = self.has_quick_path()
        twin._interleaved = self._interleaved  # an exact twin decodes from the same copy, not its own
        return twin

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] float32 / bf16 -> [..., out]
        rows = x.reshape(-1, self.in_features)  # [M, in]
        out_dtype = self.out_dtype or x.dtype
        is_few_rows = rows.shape[0] <= self.KERNEL_MAX_ROWS
        if is_few_rows and not self.lossy:  # bf16 rows as they are: the kernel's BF16 dot products, or
            # widened in it; its epilogue adds the bias and rounds to bf16 as add_ and .to would
            rows = rows if rows.dtype == torch.bfloat16 else rows.float()
            out = self.kernel.quant_linear(rows.contiguous(), self.weight, self.qtype, self.bias,
                                           out_dtype == torch.bfloat16, self.interleaved(rows.dtype))
        else:
            if is_few_rows:
                out = self.kernel.quick_linear(rows.float().contiguous(), self.weight, self.qtype)
            else:
                tile_dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
                rows = rows.to(tile_dtype)
                blocks = [rows @ self._dequantized(block, tile_dtype).t()
                          for block in self.weight.split(self.BLOCK_ROWS)]
                out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=1)
            if self.bias is not None:
                out.add_(self.bias)
        return out.to(out_dtype).view(*x.shape[:-1], self.out_features)

    def interleaved(self, dtype: torch.dtype) -> torch.Tensor | None:
        """Q5_0's, Q4_K's or Q6_K's blocks with 16 weight rows interleaved (quant_cpu.cpp `interleave`), for
        bf16 activations where the kernel has BF16 dot products: a group's scale applied once per 16
        rows, not per row. Made at the first such call from the weight as it is then (a bf16 model
        from a .gguf makes it at load): a copy beside the file's blocks, which prefill, `quick` and
        the other paths read (the 1.5B's Q4_K and Q6_K linears: 0.98 GB)."""
        if dtype != torch.bfloat16 or self.qtype not in INTERLEAVED_TYPES or not self.kernel.uses_bf16_dots():
            return None
        made_from = (self.weight.data_ptr(), self.weight.shape)  # a twin's weight is another Parameter
        if self._interleaved is None or self._interleaved[0] != made_from:
            self._interleaved = (made_from, self.kernel.interleave(self.weight, self.qtype, self.in_features))
        return self._interleaved[1]

    def dequantized(self) -> torch.Tensor:  # [out, in] float32, a fresh tensor
        return self.kernel.dequantize(self.weight, self.qtype, torch.empty(self.out_features, self.in_features))

    def _dequantized(self, block: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [rows, in], in scratch
        """float32, or bf16 as `.to(torch.bfloat16)` rounds them, written straight by the kernel (no
        float32 tile and copy: history, "A bf16 prefill's weight tiles")."""
        shape = (block.shape[0], self.in_features)
        tile = scratch(f"dequantized {dtype}", shape[0] * shape[1], dtype).view(shape)
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
    """A second model object over the same tensors in which every `QuantLinear` with a quick path
    is its lossy twin (`QuantLinear.quick`), for a middle level whose drafts the exact model
    verifies. Every module is a shallow copy (its own child, parameter and buffer dicts, the same
    tensors and attributes), so the view can be given its own attention (`set_attention`) and
    `model` is untouched and exact. Linears without a quick path (Q4_1) stay exact in the view.
    Returns `model` itself when it has no linear with a quick path (not quantized, or no such
    type): the caller then has no cheaper arithmetic to gain."""
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
