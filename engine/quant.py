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

`load_quantized_model` builds our Transformer straight from a .gguf (CPU, float32 or bf16, kernel
built); tokenizer and Hugging Face config come from transformers' GGUF reader, cached as a small
folder. Other checkpoints, dtypes and devices keep engine/loading.py's path. This module does not
quantize anything, and does not choose when it is used (engine/loading.py `load_model` does).

`quick_view(model)` is the exception, for a middle level: the same blocks multiplied with int8
activations (quant_cpu.cpp `quick_linear`), cheaper and lossy; the model itself stays exact.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from engine.config import EngineError
from engine.layouts import scratch

log = logging.getLogger(__name__)

# ggml type ids the kernel reads; others (and F16 / BF16) are dequantized to float32 at load
KERNEL_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
INTERLEAVED_TYPES = (6, 12, 14)  # Q5_0, Q4_K, Q6_K: a bf16 model decodes them from 16 interleaved rows
_SOURCE = Path(__file__).parent / "csrc" / "quant_cpu.cpp"


# F16C for the block scales; no contraction, so d * q - m rounds as numpy's two operations do
CFLAGS = ("-mf16c", "-ffp-contract=off")


@functools.cache
def cpu_quant_kernel():
    """engine/csrc/quant_cpu.cpp, or None (no AVX2 / compiler): GGUFs then load dequantized."""
    from engine.device import build_cpu_extension

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


def gguf_header_dir(gguf_path: Path, sha256: str) -> Path:
    """A small folder read once from the GGUF and cached under the file's sha256: the Hugging Face
    config and tokenizer (chat template included) by transformers, and `tensors.json`, where
    each tensor's bytes lie, so later loads map the file without parsing its metadata again."""
    from engine.families import check_hf_config, fix_gguf_config, refuse_unsupported
    from engine.loading import cache_root, complete_folder, is_complete

    out_dir = cache_root() / "models" / f"{gguf_path.stem}-{sha256[:16]}-header"
    if is_complete(out_dir) and (out_dir / "tensors.json").is_file():
        return out_dir
    refuse_unsupported(gguf_path)  # before transformers reads (and drops) what it does not know
    log.warning("reading the tokenizer and config of %s with transformers, once (a minute or so; "
                "scripts/setup.sh does it ahead); later loads read them from %s", gguf_path.name, out_dir)
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        reader = GGUFReader(gguf_path)
        tensors = [{"name": t.name, "type": int(t.tensor_type), "offset": int(t.data_offset),
                    "n_bytes": int(t.n_bytes), "shape": list(t.data.shape), "dtype": t.data.dtype.str}
                   for t in reader.tensors]
    except Exception as error:  # tokenizers raises a plain Exception for a vocabulary it cannot build
        raise EngineError(f"transformers could not read {gguf_path} as a GGUF model: {error}") from error
    fix_gguf_config(config, reader)  # what transformers' reader leaves at the defaults, from the file's keys
    check_hf_config(config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with complete_folder(out_dir, {"gguf": str(gguf_path), "sha256": sha256}) as tmp_dir:
        config.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        (tmp_dir / "tensors.json").write_text(json.dumps(tensors) + "\n")
    return out_dir


_LAYER_MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                  "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# llama.cpp's names where a family's differ: Gemma's four norms a layer, Phi-3's fused linears
_FAMILY_MODULES = {
    "gemma": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"},
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
}


# RoPE scalings llama.cpp stores as tensors, read into the config (engine/families.py fix_gguf_config)
ROPE_FACTOR_TENSORS = {"phi3": ("rope_factors_long.weight", "rope_factors_short.weight"),  # LongRoPE
                       "llama": ("rope_freqs.weight",)}  # Llama 3.x


def gguf_tensor_name(gguf_name: str, family: str) -> str | None:
    """Our (Hugging Face) parameter name of a tensor of a GGUF of `family` (a model_type), or None
    for a tensor the model has no parameter for (engine/families.py refuses such a file)."""
    fixed = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
             "output_norm.weight": "model.norm.weight"}
    if gguf_name in fixed:
        return fixed[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    _, layer, kind, what = parts
    modules = _LAYER_MODULES | _FAMILY_MODULES.get("gemma" if family.startswith("gemma") else family, {})
    has_qk_norm = family in ("qwen3", "gemma3_text")
    module = modules.get(kind) if has_qk_norm or not kind.endswith(("q_norm", "k_norm")) else None
    return None if module is None else f"model.layers.{layer}.{module}.{what}"


def _hf_name(gguf_name: str, family: str) -> str:
    name = gguf_tensor_name(gguf_name, family)
    if name is None:
        raise EngineError(f"unexpected tensor {gguf_name!r} in a {family} GGUF")
    return name


def _unpermute_rows(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order of a Llama q / k projection (its RoPE pairs interleaved), as
    transformers does; rows move whole, so the blocks of a quantized row are untouched."""
    half = rows.shape[0] // n_heads // 2
    return rows.reshape(n_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def read_gguf_tensors(gguf_path: Path, header: Path, hf_config,
                      mapped_types: tuple[int, ...] = ()) -> dict[str, tuple[torch.Tensor, int | None]]:
    """{our name: (tensor, ggml type or None)}: the kernel's types as the file's blocks [rows, row
    bytes] uint8, copied into memory, or for `mapped_types` left as pages of the file (mapped
    copy-on-write: the page cache that holds the file anyway, no second copy); everything else
    dequantized to float32 by gguf (numpy)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    file = np.memmap(gguf_path, dtype=np.uint8, mode="c")
    family = hf_config.model_type
    is_llama = family in ("llama", "mistral")  # llama.cpp permutes q / k rows of its "llama" architecture only
    n_heads = hf_config.num_attention_heads
    n_kv_heads = getattr(hf_config, "num_key_value_heads", None) or n_heads
    tensors = {}
    for t in json.loads((header / "tensors.json").read_text()):
        if t["name"] in ROPE_FACTOR_TENSORS.get("llama" if is_llama else family, ()):  # read into the config
            continue
        name, qtype = _hf_name(t["name"], family), t["type"]
        data = file[t["offset"]:t["offset"] + t["n_bytes"]].view(np.dtype(t["dtype"])).reshape(t["shape"])
        keeps_blocks = qtype in KERNEL_TYPES
        if not keeps_blocks:
            data = dequantize(data, GGMLQuantizationType(qtype)).astype(np.float32)
        if is_llama and ".self_attn.q_proj." in name:
            data = _unpermute_rows(data, n_heads)
        elif is_llama and ".self_attn.k_proj." in name:
            data = _unpermute_rows(data, n_kv_heads)
        elif family.startswith("gemma") and name.endswith("norm.weight"):
            data = data - 1  # llama.cpp stores Gemma's norms as 1 + w, as its forward multiplies
        mapped = keeps_blocks and qtype in mapped_types and isinstance(data, np.memmap)
        tensors[name] = (torch.from_numpy(data if mapped else np.array(data)), qtype if keeps_blocks else None)
    return tensors


def load_quantized_model(gguf_path: Path, sha256: str | None = None, dtype: torch.dtype = torch.float32,
                         yarn_factor: float = 1.0):
    """(our Transformer on CPU with the GGUF's linears as `QuantLinear`, tokenizer). `dtype`
    (float32 or bfloat16) is the model's: of its activations, norms, attention and KV cache; the
    linears multiply in float32 whatever it is. The LM head returns float32 logits, as wide as
    its kernel computes them (a bf16 model's would be rounded to 8 bits of mantissa: ties)."""
    from engine.families import check_tensor_names
    from engine.loading import file_sha256, finish_model, load_tokenizer, meta_model, parameter_names, split_fused

    kernel = cpu_quant_kernel()
    header = gguf_header_dir(gguf_path, sha256 or file_sha256(gguf_path))
    model, hf_config = meta_model(header, yarn_factor)
    cfg = model.config
    # a bf16 model on a CPU with BF16 dot products decodes Q5_0, Q4_K and Q6_K from interleaved copies
    # made here; their blocks in the file's order (for prefill, int8 drafts) stay pages of the file
    interleaves = dtype == torch.bfloat16 and kernel.uses_bf16_dots()
    tensors = split_fused(read_gguf_tensors(gguf_path, header, hf_config, INTERLEAVED_TYPES if interleaves else ()),
                          cfg)
    check_tensor_names(f"The GGUF {gguf_path.name}", set(tensors), parameter_names(model))
    plain = _place_quantized(model, tensors, cfg.dim, kernel)
    model.load_state_dict({name: t.to(dtype) for name, t in plain.items()}, strict=False, assign=True)
    for module in model.modules() if interleaves else ():
        if isinstance(module, QuantLinear):
            module.interleaved(dtype)
    if "model.embed_tokens.weight" in plain and not isinstance(model.lm_head, QuantLinear) and cfg.has_tied_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return finish_model(model, hf_config, torch.device("cpu"), gguf_path), load_tokenizer(header)


def _place_quantized(model: nn.Module, tensors: dict, dim: int, kernel) -> dict[str, torch.Tensor]:
    """Set each weight that keeps its blocks into the meta `model` as a `QuantEmbedding` or
    `QuantLinear` (with its bias); return the other modules' tensors, for `load_state_dict`."""
    if "lm_head.weight" not in tensors:  # tied: the LM head reads the embedding's blocks
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    quantized = [name.removesuffix(".weight") for name, (_, qtype) in tensors.items()
                 if qtype is not None and name.endswith(".weight")]
    for module_name in quantized:
        blocks, qtype = tensors[f"{module_name}.weight"]
        if module_name == "model.embed_tokens":
            model.model.embed_tokens = QuantEmbedding(blocks, qtype, dim, kernel)
        else:
            bias = tensors.get(f"{module_name}.bias", (None, None))[0]
            out_dtype = torch.float32 if module_name == "lm_head" else None
            model.set_submodule(module_name, QuantLinear(blocks, qtype, model.get_submodule(module_name).in_features,
                                                        bias, kernel, out_dtype))
    return {name: t for name, (t, _) in tensors.items() if name.rsplit(".", 1)[0] not in quantized}
