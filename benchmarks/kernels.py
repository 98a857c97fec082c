"""CPU kernel micro-benchmarks behind issue 7, each alternative timed side by side in one process.

Alternatives are interleaved (A, B, A, B, ...) and repeated; the report gives the median and the
minimum (on a shared machine the minimum is the better estimate of the work itself). Caches hold
random keys and values at the context length (costs do not depend on the values).
- attention: one layer, T new tokens over S keys (Qwen-0.5B shapes): the single SDPA call with
  a [G*T, S] boolean mask (the previous kernel, still the non-CPU fallback) vs `sdpa_attention`.
- cpu-attention: decoding's attention over every layer's cache of `--model`'s shapes (so K and V
  come from memory as in decoding, not from L3), float32 and the model's dtype (bf16 where the
  CPU has bf16 instructions), T = 1, 2, 5, 9 tokens (and a 512-token prefill chunk in bf16 where
  the kernel has BF16 dots: its packed path): `sdpa_attention` (torch's flash kernel) vs
  `cpu_attention` (our kernel, engine/csrc; in bf16 on an AVX512-BF16 CPU also with its
  widened float32 path, `set_bf16_dots(False)`); `--attention-source OLD.cpp` adds another
  version of the kernel, called directly beside this one, to compare two versions in one run:

    git show da268f2:engine/csrc/attention_cpu.cpp > /tmp/old.cpp
    python -m benchmarks.kernels --model qwen2.5-coder-1.5b --only cpu-attention --contexts 8192 \
        --threads 1 --attention-source /tmp/old.cpp
- prefill: one 512-token chunk after S cached tokens, our model vs Hugging Face's.
- decode: one token after S cached tokens, ours (with the engine's attention: our few-row
  kernel) vs Hugging Face's; and our check of 1 + 4 and 1 + 8 tokens,
  as the full level verifies drafts. Prefill and decode also run ours with MKL
  input-major weights where the engine packs them; a bf16 GGUF model on a CPU with AVX512-BF16
  also with its blocks' float32 path (`set_isa(1)`) beside the BF16 dot products.
- weights: the matmuls of one forward of T = 1, 2, 5, 9, 16, 512 tokens over every linear weight
  of the model, stored as loaded, input-major and oneDNN-packed (engine/device.py `linear_layout`).
- quant: the same matmuls (T = 1, 2, 3, 5, 9, 16, 25, 128, 512), the GGUF's blocks as in the
  file (engine/quant.py `QuantLinear`) with float32 activations and with a bf16 model's (the
  default dtype on CPUs with AVX512-BF16: the kernel in float32, prefill chunks of more than 128
  rows through bf16 tiles) vs the bf16-stored kernel (`Bf16Linear`, float32 arithmetic) and bf16
  oneDNN-packed (this CPU's bf16 model without the blocks), with the weight bytes each reads per
  forward (issue 22).
- block-types: one weight of the 1.5B's MLP shape in every block type the kernel keeps (Q4_0 ..
  Q6_K, random blocks), T = 1 and 5 rows: the blocks vs the same weights dequantized to float32.

    python -m benchmarks.kernels --only block-types --threads 2 --repeats 15
- quick: every linear of a GGUF model at T = 1, 5, 8, 9 rows (issue 22's middle level), the
  exact blocks kernel (`quant_linear`) vs the lossy one with int8 activations (`quick_linear`,
  engine/quant.py `quick_view`), and the quick kernel's relative error ||quick - exact|| / ||exact||
  per linear on the model's own activations (9 tokens of the book, captured from a forward).

    python -m benchmarks.kernels --model qwen2.5-coder-1.5b --only quick --threads 1
- exact-rows: every exact linear of a GGUF model at T = 1 to 9 rows of `--dtype` activations, what
  a check of T tokens costs in the linears. To compare two versions of the kernel, run it in each checkout in turn
  on the same core (the build cache is keyed by the source's hash).

    taskset -c 0 python -m benchmarks.kernels --model qwen2.5-coder-1.5b --only exact-rows --threads 1 --repeats 3

  or, in one process, interleaved, with `--quant-source OLD.cpp` (another version of
  engine/csrc/quant_cpu.cpp): both builds' `quant_linear` on every linear, their outputs compared
  bit for bit.

    git show 8be6e36:engine/csrc/quant_cpu.cpp > /tmp/old_quant.cpp
    python -m benchmarks.kernels --model qwen2.5-coder-1.5b --only exact-rows --quant-source /tmp/old_quant.cpp
- row-ops: a decoding step of `--model` in `--dtype` (T = 1, and a check of 1 + 4 tokens) over every
  layer's cache of S random keys, its RMSNorms and RoPE in our kernel (engine/csrc/attention_cpu.cpp,
  what a float32 or bf16 model on CPU runs) vs torch's ops, the step otherwise the same; the logits compared.

    python -m benchmarks.kernels --model qwen2.5-coder-1.5b --only row-ops --contexts 8192 --threads 2 --repeats 30
- compiled: the same matmuls (T = 1, 2, 5, 9, 16), input-major under MKL (the engine's fallback)
  vs `torch.compile` with freezing and Inductor's C++ GEMM template (weights prepacked at compile
  time; needs a C++ compiler). Not used by the engine yet: this measures what it would give.
- sampling: `sampling_probs` at T = 0.6, top-p 0.9 on 1 / 9 / 25 rows of 151,936 logits vs a
  full sort of the vocabulary (the previous top-p).

    python -m benchmarks.kernels --contexts 8192,32768 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.cli import add_common_args
from engine import layouts
from engine.attention import FEW_ROWS, cpu_attention, cpu_kernel, pick_attention, sdpa_attention, tail_mask
from engine.config import ModelConfig
from engine.device import build_cpu_extension, can_pack_linear_weights, cpu_linear_kernel, linear_layout, pick_dtype
from engine.kv.full import FullCache
from engine.layouts import Bf16Linear, PackedLinear
from engine.loading import load_hf_config, load_model
from engine.model import Attention, RMSNorm
from engine.models import resolve_model
from engine.quant import cpu_quant_kernel, is_quantized
from engine.sampling import sampling_probs

ROOT = Path(__file__).resolve().parent.parent


def side_by_side(fns: dict, repeats: int) -> dict[str, dict[str, float]]:
    """{name: {"median_ms", "min_ms"}} of interleaved calls, after one warm-up call each."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(1000 * (time.perf_counter() - t0))
    return {name: {"median_ms": statistics.median(t), "min_ms": min(t)} for name, t in times.items()}


def with_setting(set_setting, during, after, fn):
    """`fn` run with a kernel setting changed for the call (the other path, timed side by side)."""
    def run():
        set_setting(during)
        try:
            fn()
        finally:
            set_setting(after)
    return run


def masked_sdpa(q, k, v, tail):
    """The previous kernel: one SDPA call, GQA folded into the query length, a [G*T, S] mask."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    mask = tail_mask(S, tail).repeat(G, 1) if tail is not None and T > 1 else None
    return F.scaled_dot_product_attention(q.reshape(B, Hkv, G * T, D), k, v, attn_mask=mask).reshape(B, H, T, D)


def full_sort_top_p(logits, temperature, top_p):
    """The previous top-p: sort the whole vocabulary of every row."""
    probs = (logits.double() / temperature).softmax(-1)
    sorted_probs, order = probs.sort(-1, descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs / probs.sum(-1, keepdim=True)


def bench_attention(S: int, repeats: int) -> dict:
    out = {}
    for T in (1, 9, 25, 512):
        q = torch.randn(1, 14, T, 64).bfloat16()
        k, v = torch.randn(1, 2, S + T, 64).bfloat16(), torch.randn(1, 2, S + T, 64).bfloat16()
        tail = torch.ones(T, T, dtype=torch.bool).tril() if T > 1 else None
        out[f"T={T}"] = side_by_side({"masked SDPA (before)": lambda q=q, k=k, v=v, t=tail: masked_sdpa(q, k, v, t),
                                      "sdpa_attention": lambda q=q, k=k, v=v, t=tail: sdpa_attention(q, k, v, t)},
                                     repeats)
    return out


def bench_cpu_attention(S: int, repeats: int, dtype: torch.dtype, cfg: ModelConfig,
                        other: tuple[str, object] | None = None) -> dict:
    """`sdpa_attention` vs `cpu_attention` over every layer's cache of `cfg`'s shapes; with `other`
    (a build of another version of engine/csrc/attention_cpu.cpp, `other_attention_kernel`) also
    that kernel and this one called directly on the same caches, side by side in one process."""
    if cpu_kernel() is None:
        return {"skipped": "the CPU attention kernel did not build here (no AVX2 or no C++ compiler)"}
    layers, H, Hkv, D = cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    kernels = {"this kernel": cpu_kernel(), other[0]: other[1]} if other is not None else {}
    out = {}
    for kv_dtype in dict.fromkeys((torch.float32, dtype)):  # float32, and the model's dtype
        prefill = (512,) if kv_dtype == torch.bfloat16 and cpu_kernel().uses_bf16_dots() else ()  # packed path
        n = S + max((9, *prefill))
        caches = [(torch.randn(1, Hkv, n, D).to(kv_dtype), torch.randn(1, Hkv, n, D).to(kv_dtype))
                  for _ in range(layers)]
        for T in (1, 2, 5, 9, *prefill):
            q = torch.randn(1, H, T, D).to(kv_dtype)
            tail = torch.ones(T, T, dtype=torch.bool).tril() if T > 1 else None

            def every_layer(attend, q=q, T=T, tail=tail, caches=caches):
                for k, v in caches:
                    attend(q, k[:, :, :S + T], v[:, :, :S + T], tail)

            def every_layer_direct(kernel, q=q.reshape(1, Hkv, H // Hkv * T, D).contiguous(), caches=caches):
                for k, v in caches:  # the unmasked keys, as cpu_attention calls the kernel for them
                    kernel.few_row_attention(q, k[:, :, :S], v[:, :, :S])
            name = f"T={T}" if kv_dtype == torch.float32 else f"{str(kv_dtype).removeprefix('torch.')} T={T}"
            fns = {"sdpa_attention": lambda f=every_layer: f(sdpa_attention),
                   "cpu_attention": lambda f=every_layer: f(cpu_attention)}
            if kv_dtype == torch.bfloat16 and cpu_kernel().uses_bf16_dots() and T not in prefill:  # widened
                fns["cpu_attention, widened to float32"] = with_setting(cpu_kernel().set_bf16_dots, False, True,
                                                                    lambda f=every_layer: f(cpu_attention))
            if H // Hkv * T <= FEW_ROWS:
                fns |= {kname: lambda f=every_layer_direct, k=k: f(k) for kname, k in kernels.items()}
            out[name] = side_by_side(fns, repeats)
    return out


def other_attention_kernel(source: Path) -> tuple[str, object] | None:
    """(the file's name, its build) for `--attention-source`, or None where it does not build."""
    kernel = build_cpu_extension("bookchat_attention_cpu_other", source, "no comparison")
    return (source.name, kernel) if kernel is not None else None


def store_weights_input_major(model) -> None:
    """Every linear weight input-major (strides (1, out), same values): MKL's faster orientation
    for one row, the engine's layout before it packed linears; a tied embedding stays tied."""
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(module.weight.t().contiguous().t(), requires_grad=False)
    if tied:
        model.model.embed_tokens.weight = model.lm_head.weight


class Models:
    """Our model and Hugging Face's, with caches holding the same random S entries. Where the
    engine packs its linears or stores them bf16, a second copy of ours keeps MKL's input-major
    layout (the fallback, and the engine's layout before either) to time them side by side."""

    def __init__(self, name: str, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.ours, layout = engine_model(name, dtype)
        self.ours_input_major = None
        if layout in ("packed", "bf16-stored"):
            self.ours_input_major, _ = load_model(name, dtype, torch.device("cpu"))
            store_weights_input_major(self.ours_input_major)
            self.ours_input_major.set_attention(pick_attention(torch.device("cpu"), use_cpu_kernel=True))
        self.hf = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype, attn_implementation="sdpa",
                                                       local_files_only=True).eval()
        self.dtype = dtype

    def caches(self, S: int, extra: int):
        from transformers import DynamicCache

        c = self.ours.config
        full = random_full_cache(c, S, S + extra, self.dtype)
        hf = DynamicCache(config=self.hf.config)
        for layer_idx in range(c.n_layers):
            hf.update(full.k[layer_idx, :, :, :S].clone(), full.v[layer_idx, :, :, :S].clone(), layer_idx)
        return full, hf

    def hf_step(self, cache, S: int, T: int):
        ids = torch.full((1, T), 11)

        def step():
            extra = cache.get_seq_length() - S
            if extra:
                cache.crop(-extra)
            with torch.no_grad():
                self.hf(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1,
                        position_ids=torch.arange(S, S + T)[None])
        return step


def engine_model(name: str, dtype: torch.dtype):
    """Our model of `name` on the CPU laid out as Engine lays it out (a GGUF's blocks as in the file,
    else the layout `linear_layout` picks) with the engine's attention; (model, layout)."""
    cpu = torch.device("cpu")
    model, _ = load_model(name, dtype, cpu)
    fits_bf16 = dtype == torch.float32 and layouts.linear_weights_fit_bf16(model)
    layout = "as loaded" if is_quantized(model) else linear_layout(cpu, dtype, fits_bf16)
    layouts.lay_out_linears(model, layout)
    model.set_attention(pick_attention(cpu, use_cpu_kernel=True))  # our few-row kernel
    return model, layout


def random_full_cache(cfg: ModelConfig, S: int, capacity: int, dtype: torch.dtype) -> FullCache:
    """A full cache of `capacity` slots holding S random keys and values (costs do not depend on them)."""
    full = FullCache(cfg.n_layers, 1, cfg.n_kv_heads, cfg.head_dim, capacity, dtype, torch.device("cpu"))
    full.k.normal_()
    full.v.normal_()
    full.length = S
    return full


def ours_step(model, full: FullCache, S: int, n_draft: int = 0, n_logits: int = 0):
    """A function running one forward of a token and a chain of `n_draft` drafted tokens after S cached keys."""
    ids = torch.tensor([[11] + [100 + d for d in range(n_draft)]])
    pos = torch.arange(S, S + n_draft + 1)

    def step():
        full.truncate(S)
        model(ids, pos, full, None, n_logits=n_logits or n_draft + 1)
    return step


def bench_row_ops(source: str, S: int, repeats: int, dtype: torch.dtype) -> dict:
    """A step of `source` in `dtype` over S random keys with the norms and RoPE in our kernel vs in
    torch's ops: {name: {"median_ms", "min_ms"}}, and "logits_max_abs_diff" between the two."""
    model, _ = engine_model(source, dtype)
    modules = [m for m in model.modules() if isinstance(m, RMSNorm | Attention)]
    if cpu_kernel() is None or any(m.kernel is None for m in modules):
        return {"skipped": "no CPU kernel here, or a model shape it does not take"}

    def set_kernel(on: bool) -> None:
        for m in modules:
            m.kernel = cpu_kernel() if on else None
    full = random_full_cache(model.config, S, S + 16, dtype)
    fns = {}
    for label, n_draft in (("T=1", 0), ("check 1+4 chain", 4)):
        step = ours_step(model, full, S, n_draft, 1)
        fns |= {f"kernel {label}": with_setting(set_kernel, True, True, step),
                f"torch {label}": with_setting(set_kernel, False, True, step)}
    with torch.inference_mode():
        out = side_by_side(fns, repeats)
        ids, pos = torch.tensor([[11]]), torch.tensor([S])
        logits = []
        for on in (True, False):
            set_kernel(on)
            full.truncate(S)
            logits.append(model(ids, pos, full))
        set_kernel(True)
    out["logits_max_abs_diff"] = (logits[0] - logits[1]).abs().max().item()
    return out


def bench_prefill(models: Models, S: int, repeats: int, chunk: int = 512) -> dict:
    full, hf = models.caches(S, chunk)
    ids = torch.randint(0, models.ours.config.vocab_size, (1, chunk), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(S, S + chunk)

    def ours(model):
        full.truncate(S)
        model(ids, pos, full, None, n_logits=1)

    def hf_chunk():
        extra = hf.get_seq_length() - S
        if extra:
            hf.crop(-extra)
        with torch.no_grad():
            models.hf(input_ids=ids, past_key_values=hf, use_cache=True, logits_to_keep=1, position_ids=pos[None])
    fns = {"ours": lambda: ours(models.ours), "hf": hf_chunk}
    if models.ours_input_major is not None:
        fns["ours input-major"] = lambda: ours(models.ours_input_major)
    out = side_by_side(fns, repeats)
    for r in out.values():
        r["tokens_per_s"] = 1000 * chunk / r["min_ms"]
    return out


def bench_decode(models: Models, S: int, repeats: int) -> dict:
    full, hf = models.caches(S, 32)
    fns = {"hf T=1": models.hf_step(hf, S, 1)}
    for name, model in (("ours", models.ours), ("ours input-major", models.ours_input_major)):
        if model is not None:
            fns |= {f"{name} T=1": ours_step(model, full, S, 0, 1),
                    f"{name} check 1+4 chain": ours_step(model, full, S, 4),
                    f"{name} check 1+8 chain": ours_step(model, full, S, 8)}
    quant = cpu_quant_kernel() if is_quantized(models.ours) else None
    if models.dtype == torch.bfloat16 and quant is not None and quant.uses_bf16_dots():
        # the blocks' float32 path on the widened activations (set_isa 1)
        fns |= {"ours, float32 dots T=1": with_setting(quant.set_isa, 1, -1, ours_step(models.ours, full, S, 0, 1)),
                "ours, float32 dots check 1+4 chain": with_setting(quant.set_isa, 1, -1,
                                                                   ours_step(models.ours, full, S, 4))}
    return side_by_side(fns, repeats)


def model_linears(source: str, dtype: torch.dtype) -> list[torch.nn.Linear]:
    """Every linear layer of the model, as loaded."""
    model, _ = load_model(resolve_model(source), dtype, torch.device("cpu"))
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear)]


def bench_weights(source: str, dtype: torch.dtype, repeats: int) -> dict:
    """The matmuls of one forward of T tokens (every linear weight of the model, no attention),
    weights as loaded ([out, in], rows contiguous), input-major, oneDNN-packed and, for float32
    weights that are bf16 values, bf16-stored (the layouts of engine/device.py `linear_layout`);
    T = 512 is a prefill chunk."""
    linears = model_linears(source, dtype)
    weights = [m.weight for m in linears]
    input_major = [w.t().contiguous().t() for w in weights]
    layouts = {"as loaded": lambda x: [F.linear(x[w.shape[1]], w) for w in weights],
               "input-major": lambda x: [F.linear(x[w.shape[1]], w) for w in input_major]}
    if can_pack_linear_weights(dtype):
        packed = [PackedLinear(m) for m in linears]
        layouts["packed"] = lambda x: [m(x[m.in_features]) for m in packed]
    kernel = cpu_linear_kernel()
    if dtype == torch.float32 and kernel is not None and all(torch.equal(w, w.bfloat16().float()) for w in weights):
        stored = [Bf16Linear(m, kernel) for m in linears]
        layouts["bf16-stored"] = lambda x: [m(x[m.in_features]) for m in stored]
    out = {}
    for T in (1, 2, 5, 9, 16, 32, 64, 512):
        x = {n: torch.randn(T, n, dtype=dtype) for n in {w.shape[1] for w in weights}}
        with torch.inference_mode():  # as the engine's forward runs
            out[f"T={T}"] = side_by_side({name: lambda f=f, x=x: f(x) for name, f in layouts.items()},
                                         repeats if T < 512 else max(2, repeats // 3))
        print(f"weights T={T}: {json.dumps(out[f'T={T}'], default=lambda v: round(v, 2))}", flush=True)
    return out


def bench_quant(source: str, repeats: int) -> dict:
    """Every linear of the model at T rows: GGUF blocks (QuantLinear) vs bf16-stored (Bf16Linear)."""
    from engine.quant import QuantLinear

    kernel = cpu_linear_kernel()
    if cpu_quant_kernel() is None or kernel is None:
        return {"skipped": "the quantized or the bf16-stored linear kernel did not build here"}
    model, _ = load_model(source, torch.float32, torch.device("cpu"))  # a packaged GGUF: its blocks
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    stored = [Bf16Linear(m, kernel) for m in model_linears(source, torch.float32)]  # bf16-rounded copy
    if not quant:
        return {"skipped": f"{source} did not load as GGUF blocks"}
    out = {"weight_bytes": {"quant": sum(m.weight.numel() for m in quant),
                            "bf16-stored": sum(2 * m.in_features * m.out_features for m in stored)}}
    packed = []  # the default here where the CPU has AVX512-BF16 (bf16 model, oneDNN-packed)
    if pick_dtype("auto", torch.device("cpu")) == torch.bfloat16 and can_pack_linear_weights(torch.bfloat16):
        packed = [PackedLinear(m) for m in model_linears(source, torch.bfloat16)]
        out["weight_bytes"]["bf16 packed"] = out["weight_bytes"]["bf16-stored"]
    for T in (1, 2, 3, 5, 9, 16, 25, 128, 512):
        x = {n: torch.randn(T, n) for n in {m.in_features for m in stored}}
        x16 = {n: t.bfloat16() for n, t in x.items()}
        fns = {"quant": lambda x=x: [m(x[m.in_features]) for m in quant],
               "quant, bf16 model": lambda x=x16: [m(x[m.in_features]) for m in quant],
               "bf16-stored": lambda x=x: [m(x[m.in_features]) for m in stored]}
        if packed:
            fns["bf16 packed"] = lambda x=x16: [m(x[m.in_features]) for m in packed]
        with torch.inference_mode():
            out[f"T={T}"] = side_by_side(fns, repeats)
        print(f"quant T={T}: {json.dumps(out[f'T={T}'], default=lambda v: round(v, 2))}", flush=True)
    return out


# where each type's float16 scales lie in its block (random bytes elsewhere: the time does not
# depend on the codes, but a NaN or subnormal scale could slow the arithmetic)
SCALE_BYTES = {2: (0,), 3: (0, 2), 6: (0,), 8: (0,), 11: (108,), 12: (0, 2), 13: (0, 2), 14: (208,)}


def bench_block_types(repeats: int, n_out: int = 1536, n_in: int = 8960) -> dict:
    """Every block type the kernel keeps, one [n_out, n_in] weight (the 1.5B's MLP down
    projection), T = 1 and 5 float32 rows: its blocks (`QuantLinear`) vs the same weights
    dequantized to float32 (what a type the kernel does not keep runs), with the bytes each reads."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from engine.quant import KERNEL_TYPES, QuantLinear

    kernel = cpu_quant_kernel()
    if kernel is None:
        return {"skipped": "engine/csrc/quant_cpu.cpp did not build here"}
    rng, out = np.random.default_rng(0), {}
    for qtype, name in sorted(KERNEL_TYPES.items()):
        n_values, n_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        blocks = rng.integers(0, 256, (n_out, n_in // n_values, n_bytes), dtype=np.uint8)
        for at in SCALE_BYTES[qtype]:
            blocks[..., at:at + 2] = np.float16(1e-3) * rng.random((n_out, n_in // n_values, 1)).astype(np.float16)
        linear = QuantLinear(torch.from_numpy(blocks.reshape(n_out, -1)), qtype, n_in, None, kernel)
        dense = linear.dequantized()
        out[name] = {"MB read": {"blocks": blocks.nbytes / 1e6, "float32": dense.numel() * 4 / 1e6}}
        for T in (1, 5):
            x = torch.randn(T, n_in)
            fns = {"blocks": lambda x=x, w=linear: w(x), "float32": lambda x=x, w=dense: x @ w.T}
            with torch.inference_mode():
                out[name][f"T={T}"] = side_by_side(fns, repeats)
        print(f"block-types {name}: {json.dumps(out[name], default=lambda v: round(v, 3))}", flush=True)
    return out


def bench_quick(source: str, repeats: int) -> dict:
    """Every linear of the GGUF model at T rows: exact blocks kernel vs quick (int8 activations)."""
    from engine.quant import KERNEL_TYPES, QuantLinear

    if cpu_quant_kernel() is None:
        return {"skipped": "the quantized linear kernel did not build here"}
    model, tokenizer = load_model(source, torch.float32, torch.device("cpu"))
    exact = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not exact:
        return {"skipped": f"{source} did not load as GGUF blocks"}
    quick = [m.quick() for m in exact]
    types: dict[str, int] = {}
    for m in exact:
        name = KERNEL_TYPES[m.qtype] + ("" if m.has_quick_path() else " (no quick path)")
        types[name] = types.get(name, 0) + 1
    out = {"linears": types, "weight_bytes": sum(m.weight.numel() for m in exact),
           "vnni": bool(cpu_quant_kernel().quick_uses_vnni())}
    for T in (1, 5, 8, 9):
        x = {n: torch.randn(T, n) for n in {m.in_features for m in exact}}
        with torch.inference_mode():
            out[f"T={T}"] = side_by_side({"exact": lambda x=x: [m(x[m.in_features]) for m in exact],
                                          "quick": lambda x=x: [m(x[m.in_features]) for m in quick]}, repeats)
        print(f"quick T={T}: {json.dumps(out[f'T={T}'], default=lambda v: round(v, 2))}", flush=True)
    inputs = {}  # each linear's input on 9 tokens of the book
    hooks = [m.register_forward_pre_hook(lambda m, args: inputs.__setitem__(m, args[0].reshape(-1, m.in_features)))
             for m in exact]
    ids = torch.tensor([tokenizer.encode((ROOT / "assets" / "persuasion.txt").read_text()[:400])[:9]])
    c = model.config
    model(ids, torch.arange(ids.shape[1]), FullCache(c.n_layers, 1, c.n_kv_heads, c.head_dim, 16, torch.float32,
                                                     torch.device("cpu")))
    for h in hooks:
        h.remove()
    errors: dict[str, list[float]] = {}
    with torch.inference_mode():
        for e, q in zip(exact, quick):
            if q.lossy:
                ref = e(inputs[e])
                errors.setdefault(KERNEL_TYPES[e.qtype], []).append(float((q(inputs[e]) - ref).norm() / ref.norm()))
    out["relative_error"] = {t: {"median": statistics.median(v), "max": max(v), "n": len(v)} for t, v in errors.items()}
    print("| rows | exact ms | quick ms | speed-up |\n|---:|---:|---:|---:|")
    for T in (1, 5, 8, 9):
        a, b = out[f"T={T}"]["exact"]["min_ms"], out[f"T={T}"]["quick"]["min_ms"]
        print(f"| {T} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
    for t, v in out["relative_error"].items():
        print(f"quick error {t} ({v['n']} linears, real activations): median {v['median']:.2e}, max {v['max']:.2e}")
    return out


def bench_exact_rows(source: str, repeats: int, other_source: Path | None = None,
                     dtype: torch.dtype = torch.float32) -> dict:
    """Every exact linear of the GGUF model (`quant_linear`) at T rows of `dtype` activations: {T:
    {"median_ms", "min_ms"}}; with `other_source`, {T: {"this": ..., OLD.cpp: ..., "same_bits":
    bool}}, the kernels alone (no bias, no module call), interleaved. This build takes the blocks as
    the model's linears do (a bf16 model's Q4_K / Q6_K: their interleaved copies); OLD.cpp the
    file's."""
    from engine.quant import CFLAGS, QuantLinear

    model, _ = load_model(source, dtype, torch.device("cpu"))
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if not linears:
        return {"skipped": f"{source} did not load as GGUF blocks"}
    other = other_source and build_cpu_extension("bookchat_quant_cpu_other", other_source, "no comparison",
                                                 extra_cflags=CFLAGS)
    out = {}
    with torch.inference_mode():
        for T in (1, 2, 3, 4, 5, 6, 8, 9):
            x = {n: torch.randn(T, n).to(dtype) for n in {m.in_features for m in linears}}
            if not other:
                out[T] = side_by_side({"exact": lambda x=x: [m(x[m.in_features]) for m in linears]}, repeats)["exact"]
                continue
            calls = {"this": lambda x=x: [cpu_quant_kernel().quant_linear(x[m.in_features], m.weight, m.qtype,
                                                                          interleaved=m.interleaved(dtype))
                                          for m in linears],
                     other_source.name: lambda x=x: [other.quant_linear(x[m.in_features], m.weight, m.qtype)
                                                     for m in linears]}
            out[T] = side_by_side(calls, repeats)
            out[T]["same_bits"] = all(map(torch.equal, *(f() for f in calls.values())))
    if other:
        print(f"| rows | this min ms | {other_source.name} min ms | speed-up | same bits |\n|---:|---:|---:|---:|---|")
        for T, r in out.items():
            mine, theirs = r["this"]["min_ms"], r[other_source.name]["min_ms"]
            print(f"| {T} | {mine:.1f} | {theirs:.1f} | {theirs / mine:.2f}x | {r['same_bits']} |")
        return out
    print("| rows | min ms | vs 1 row |\n|---:|---:|---:|")
    for T, r in out.items():
        print(f"| {T} | {r['min_ms']:.1f} | {r['min_ms'] / out[1]['min_ms']:.2f}x |")
    return out


INDUCTOR_CPU_GEMM = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def bench_compiled(source: str, dtype: torch.dtype, repeats: int) -> dict:
    """Every linear of the model at T tokens: eager input-major vs compiled (one graph, T dynamic)."""
    # plain nn.Linear copies of the weights, as measured (compiling the loaded modules themselves
    # was not tried: they may hold inference-mode tensors)
    linears = torch.nn.ModuleList()
    for m in model_linears(source, dtype):
        copy = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, dtype=dtype)
        with torch.no_grad():
            copy.weight.copy_(m.weight)
            if m.bias is not None:
                copy.bias.copy_(m.bias)
        linears.append(copy.requires_grad_(False))
    dims = sorted({m.in_features for m in linears})

    class Dense(torch.nn.Module):  # x per input width -> every linear's output
        def __init__(self):
            super().__init__()
            self.linears = linears

        def forward(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
            return [m(xs[dims.index(m.in_features)]) for m in self.linears]

    eager = [(m.weight.t().contiguous().t(), m.bias) for m in linears]  # weights as the engine stores them
    dense = Dense().eval()
    compiled = torch.compile(dense)  # T dynamic (below), widths static
    out = {}
    with torch.no_grad(), torch._inductor.config.patch(INDUCTOR_CPU_GEMM):  # read when compiling
        for T in (1, 2, 5, 9, 16):
            xs = [torch.randn(T, d, dtype=dtype) for d in dims]
            for x in xs if T > 1 else ():
                torch._dynamo.mark_dynamic(x, 0)  # one graph for every T >= 2 (T = 1 gets its own)
            t0 = time.perf_counter()
            got = compiled(xs)
            first_call_s = time.perf_counter() - t0
            want = [F.linear(xs[dims.index(w.shape[1])], w, b) for w, b in eager]
            out[f"T={T}"] = side_by_side(
                {"eager input-major": lambda xs=xs: [F.linear(xs[dims.index(w.shape[1])], w, b) for w, b in eager],
                 "compiled": lambda xs=xs: compiled(xs)}, repeats)
            out[f"T={T}"]["first_call_s"] = first_call_s
            out[f"T={T}"]["max_abs_diff"] = max(float((a - b).abs().max()) for a, b in zip(got, want))
            print(f"compiled T={T}: {json.dumps(out[f'T={T}'], default=lambda x: round(x, 6))}", flush=True)
    return out


def bench_sampling(repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for rows in (1, 9, 25):
        # LM-like logits: a few strong candidates over a long tail, bf16-rounded as a bf16 model's
        logits = (torch.randn(rows, 151_936, generator=gen) * 2.5).bfloat16().float()
        logits[:, :64] += 12 * torch.rand(rows, 64, generator=gen)
        out[f"rows={rows}"] = side_by_side(
            {"full sort (before)": lambda x=logits: full_sort_top_p(x, 0.6, 0.9),
             "sampling_probs": lambda x=logits: sampling_probs(x, 0.6, 0, 0.9)}, repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "kernels")
    p.add_argument("--contexts", default="8192,32768")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--only", default="attention,cpu-attention,prefill,decode,sampling,weights",
                   help="comma-separated; also: compiled, quant, block-types, quick, exact-rows, row-ops")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="model dtype; auto = the engine's choice (bf16 with AMX or AVX512-BF16, else float32)")
    p.add_argument("--attention-source", type=Path, default=None,
                   help="cpu-attention: another version of engine/csrc/attention_cpu.cpp to time beside this one")
    p.add_argument("--quant-source", type=Path, default=None,
                   help="exact-rows: another version of engine/csrc/quant_cpu.cpp to time beside this one")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    only = set(args.only.split(","))
    report = {"command": "python -m benchmarks.kernels " + " ".join(sys.argv[1:] if argv is None else argv),
              "threads": args.threads, "load_avg_at_start": list(__import__("os").getloadavg()), "results": {}}
    dtype = pick_dtype(args.dtype, torch.device("cpu"))
    report["dtype"] = str(dtype).removeprefix("torch.")
    models = Models(args.model, dtype) if only & {"prefill", "decode"} else None
    if "cpu-attention" in only:
        cfg = ModelConfig.from_hf(load_hf_config(resolve_model(args.model)))
        other = other_attention_kernel(args.attention_source) if args.attention_source else None
    for S in (int(s) for s in args.contexts.split(",")):
        for name, bench in (("attention", lambda S: bench_attention(S, args.repeats)),
                            ("cpu-attention", lambda S: bench_cpu_attention(S, args.repeats, dtype, cfg, other)),
                            ("prefill", lambda S: bench_prefill(models, S, args.repeats)),
                            ("decode", lambda S: bench_decode(models, S, args.repeats)),
                            ("row-ops", lambda S: bench_row_ops(args.model, S, args.repeats, dtype))):
            if name in only:
                report["results"][f"{name} S={S}"] = result = bench(S)
                print(f"{name} S={S}: {json.dumps(result, indent=None, default=lambda x: round(x, 2))}", flush=True)
    if "weights" in only:
        report["results"]["weights"] = bench_weights(args.model, dtype, args.repeats)
        print(f"weights: {json.dumps(report['results']['weights'], default=lambda x: round(x, 2))}", flush=True)
    if "quant" in only:
        report["results"]["quant"] = bench_quant(args.model, args.repeats)
    if "block-types" in only:
        report["results"]["block-types"] = bench_block_types(args.repeats)
    if "quick" in only:
        report["results"]["quick"] = bench_quick(args.model, args.repeats)
    if "exact-rows" in only:
        report["results"]["exact-rows"] = bench_exact_rows(args.model, args.repeats, args.quant_source, dtype)
    if "compiled" in only:  # not in the default set: it compiles for a minute or two
        report["results"]["compiled"] = bench_compiled(args.model, dtype, args.repeats)
    if "sampling" in only:
        report["results"]["sampling"] = bench_sampling(args.repeats)
        print(f"sampling: {json.dumps(report['results']['sampling'], default=lambda x: round(x, 2))}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
