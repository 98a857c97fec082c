"""`python -m tools selftest`: each GPU path against its reference, on the user's machine.

A tiny random Llama (built from a config, nothing downloaded) runs each device-specific path next
to the exact path it replaces: flash-attn against SDPA over the offloaded cache's views; CUDA-graph
replay against eager steps; the offloaded full cache (4 layers, 1 resident: the double buffer's
halves are reused) against the on-chip one; two tensor-parallel ranks against one process; the
memory planner against the peak `torch.cuda.max_memory_allocated` measured. A real packaged GGUF
(the smallest assembled one) then runs the same way: every default stack and the offloaded cache
give plain decoding's greedy tokens, two ranks give one process's, its plan is checked against
CUDA's peak, and a short speed table times plain decoding and the default stack at two lengths.
Without a GPU the CPU stand-ins run (the same code as the tests: CPU "host" and "device"
tensors, uncaptured static steps, gloo ranks) and the checks that need CUDA say so; `Sizes`
shrinks the real model's lengths for a dry run.
Returns `Check` results; the CLI (tools/__main__.py) prints them and writes them as JSON.
"""

from __future__ import annotations

import functools
import platform
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
from transformers import LlamaConfig

from engine import attention, graphs, parallel
from engine.config import EngineConfig, ModelConfig, RetrievalConfig, SamplingConfig
from engine.kv.offload import OffloadCache
from engine.memory import DeviceBudget, Workload, free_memory_bytes, plan_memory
from engine.model import Transformer
from engine.models import gguf_path
from engine.session import CHAT_CAPACITY_TOKENS, Engine

N_DOC_TOKENS, N_NEW_TOKENS, VOCAB = 400, 16, 256
RETRIEVAL = RetrievalConfig(budget_tokens=128, sink_tokens=4, window_tokens=32, chunk_tokens=8,
                            n_score_queries=4, rebuild_every_tokens=16)


@dataclass
class Check:
    name: str
    status: str  # "pass", "fail", "skipped"
    seconds: float
    detail: str  # what was compared and what came out, or why it was skipped
    rows: list[dict] = field(default_factory=list)  # a table's rows (the speed check's)


@dataclass(frozen=True)
class Sizes:
    """The real model's lengths: a GPU's defaults finish in minutes; `small` is a CPU dry run."""

    n_doc_tokens: int = 2048  # the real model's losslessness and offload checks
    speed_tokens: tuple[int, ...] = (8192, 32768)
    n_new_tokens: int = 64  # per timed answer

    @classmethod
    def small(cls) -> Sizes:
        return cls(n_doc_tokens=256, speed_tokens=(256, 512), n_new_tokens=8)


# the smallest packaged GGUF that holds each length (engine/models.py); the first assembled wins
REAL_MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b")
REAL_MODEL_LONG = "qwen2.5-coder-0.5b"  # native 32K: the speed table's lengths


def tiny_model(device: torch.device, dtype: torch.dtype, seed: int = 0, n_layers: int = 2) -> Transformer:
    """A random Llama: hidden 256, 4 query / 2 KV heads of 64, peaked logits."""
    hf = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=n_layers,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                     bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_hf(hf), hf)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return model.to(device, dtype).eval()


def doc_ids(seed: int = 0) -> list[int]:
    """A document with repeats, so the n-gram drafter and the retrieval level have work."""
    g = torch.Generator().manual_seed(seed)
    part = torch.randint(0, VOCAB, (150,), generator=g).tolist()
    return (part + torch.randint(0, VOCAB, (150,), generator=g).tolist() + part * 2)[:N_DOC_TOKENS]


def engine_config(device: torch.device, **overrides) -> EngineConfig:
    settings = dict(target="selftest", device=str(device), retrieval=RETRIEVAL, prefill_chunk_tokens=128,
                    use_cpu_kernel=False, gamma_bottom=3, gamma_middle=3)  # fixed draft lengths: comparable
    return EngineConfig(**(settings | overrides))


def answer(engine, levels: str = "ngram>retrieval>full", doc: list[int] | None = None) -> list[int]:
    """Greedy tokens of two questions about the document (a chat over one prefill)."""
    session = engine.open(doc or doc_ids())
    session.set_levels(levels)
    tokens = []
    for question in ([5, 6, 7], [8, 9]):
        tokens += [t for e in session.ask(question, SamplingConfig(max_new_tokens=N_NEW_TOKENS)) for t in e.tokens]
    return tokens


def same_tokens(got: list[int], want: list[int], what: str) -> tuple[str, str]:
    """A check's status and detail: whether `got` equals the reference `want`."""
    if got == want:
        return "pass", f"{what}: {len(got)} greedy tokens equal"
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return "fail", f"{what}: tokens differ from position {first} of {len(want)}"


def check_flash_attn(device, dtype, sizes) -> tuple[str, str]:
    if device.type != "cuda":
        return "skipped", "needs a CUDA device (flash-attn runs only there)"
    if not attention.has_flash_attn():
        return "skipped", ("flash-attn is not installed: attention runs on torch SDPA "
                           "(pip install -r requirements-gpu.txt)")
    g = torch.Generator(device=device).manual_seed(0)
    cache = OffloadCache(2, 1, 2, 64, 1024, torch.bfloat16, device, n_resident_layers=1)
    worst = 0.0
    for T, S in ((1, 700), (7, 700), (128, 1000)):
        cache.truncate(0)
        chain = torch.ones(T, T, dtype=torch.bool, device=device).tril() if T > 1 else None
        for layer_idx in range(2):
            k, v = (torch.randn(1, 2, S, 64, generator=g, device=device, dtype=torch.bfloat16) for _ in "kv")
            k_view, v_view = cache.update(layer_idx, k, v)  # token-major storage, [B, Hkv, S, D] views
            q = torch.randn(1, 4, T, 64, generator=g, device=device, dtype=torch.bfloat16)
            got = attention.flash_attention(q, k_view[:, :, :S], v_view[:, :, :S], chain, False)
            want = attention.sdpa_attention(q.float(), k.float(), v.float(), chain, False)
            worst = max(worst, (got.float() - want).abs().max().item())
        cache.advance(S)
    ok = worst <= 2e-2  # bf16 inputs, float32 reference
    return ("pass" if ok else "fail"), f"flash_attn_with_kvcache vs SDPA (float32), max |diff| {worst:.2e} (limit 2e-2)"


def check_cuda_graphs(device, dtype, sizes) -> tuple[str, str]:
    dtype = torch.float32  # the static step attends over the whole capacity, masked: other sums than eager
    eager = answer(Engine(engine_config(device), tiny_model(device, dtype)))
    if device.type == "cuda":
        captured = Engine(engine_config(device, use_cuda_graphs=True), tiny_model(device, dtype))
        return same_tokens(answer(captured), eager, "captured one-token steps vs eager")
    graphs.force_static_steps = True  # the CPU stand-in: the static steps CUDA would capture, uncaptured
    try:
        status, detail = same_tokens(answer(Engine(engine_config(device), tiny_model(device, dtype))), eager,
                                     "static one-token steps (uncaptured) vs eager")
    finally:
        graphs.force_static_steps = False
    return status, detail + "; the CUDA capture itself needs a GPU"


def check_offload(device, dtype, sizes) -> tuple[str, str]:
    """4 layers, 1 resident: the offloaded layers stream through both halves of the double buffer, each reused."""
    on_chip = answer(Engine(engine_config(device), tiny_model(device, dtype, n_layers=4)))
    offloaded = Engine(engine_config(device, offload_kv=True, resident_kv_layers=1),
                       tiny_model(device, dtype, n_layers=4))
    status, detail = same_tokens(answer(offloaded), on_chip, "offloaded KV (1 of 4 layers resident) vs on chip")
    where = "pinned host memory and a side stream" if device.type == "cuda" else "CPU stand-in: inline copies"
    return status, f"{detail} ({where})"


def tp_rank_engine(device_type: str) -> Engine:
    """One rank's engine of the tiny model (float32: ranks sum partial products in another order)."""
    device = torch.device(device_type)
    model = tiny_model(torch.device("cpu"), torch.float32)
    n_ranks = dist.get_world_size() if dist.is_initialized() else 1
    if n_ranks > 1:
        parallel.shard(model, dist.get_rank(), n_ranks)
        device = parallel.rank_device(device)
    torch.set_num_threads(1)
    return Engine(engine_config(device, n_gpus=n_ranks), model.to(device))


def check_tensor_parallel(device, dtype, sizes) -> tuple[str, str]:
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        return "skipped", "needs 2 GPUs"
    one = answer(tp_rank_engine(device.type))
    leader = parallel.start(functools.partial(tp_rank_engine, device.type), 2, device)
    try:
        two = answer(leader)
    finally:
        leader.close()
    backend = "NCCL on 2 GPUs" if device.type == "cuda" else "gloo on CPU (stand-in for NCCL)"
    return same_tokens(two, one, f"2 ranks ({backend}) vs one process")


def check_planner(device, dtype, sizes) -> tuple[str, str]:
    if device.type != "cuda":
        return "skipped", "needs CUDA (compares the plan with torch.cuda.max_memory_allocated)"
    return planned_vs_peak(device, lambda: Engine(engine_config(device), tiny_model(device, dtype)), doc_ids())


def real_model(names: tuple[str, ...] = REAL_MODELS) -> str | None:
    """The first of `names` whose packaged GGUF is assembled here, or None (nothing is downloaded)."""
    return next((name for name in names if gguf_path(name).is_file()), None)


NOT_ASSEMBLED = "no packaged GGUF is assembled here (python -m tools.models --only smollm2-135m)"


def real_engine(device: torch.device, name: str, **overrides) -> Engine:
    """The packaged model `name` as the app loads it (a GPU: dequantized; a CPU: its blocks), no
    draft model; float32 unless overridden, so stacks and ranks compare token for token."""
    settings = dict(target=name, draft=None, levels="plain", device=str(device), dtype="float32")
    return Engine.load(EngineConfig(**(settings | overrides)))


def real_doc(n_tokens: int, vocab_size: int, seed: int = 0) -> list[int]:
    """`n_tokens` ids with a repeated passage (the n-gram and retrieval levels find it)."""
    g = torch.Generator().manual_seed(seed)
    part = torch.randint(0, vocab_size, (max(n_tokens // 4, 1),), generator=g).tolist()
    rest = torch.randint(0, vocab_size, (n_tokens,), generator=g).tolist()
    return (part + rest[:n_tokens // 4] + part + rest)[:n_tokens]


def check_real_gguf(device, dtype, sizes) -> tuple[str, str]:
    """The default stacks and the offloaded cache (1 resident layer of many) against plain
    decoding on real weights."""
    name = real_model()
    if name is None:
        return "skipped", NOT_ASSEMBLED
    engine = real_engine(device, name)
    doc = real_doc(sizes.n_doc_tokens, engine.target.config.vocab_size)
    plain = answer(engine, "plain", doc)
    results = [same_tokens(answer(engine, levels, doc), plain, levels)
               for levels in ("ngram>retrieval>full", "retrieval>full")]
    del engine
    offloaded = real_engine(device, name, offload_kv=True, resident_kv_layers=1)
    n_layers = offloaded.target.config.n_layers
    results.append(same_tokens(answer(offloaded, "plain", doc), plain,
                               f"offloaded KV, 1 of {n_layers} layers resident"))
    status = "fail" if any(s == "fail" for s, _ in results) else "pass"
    return status, f"{name}, {len(doc):,} tokens: " + "; ".join(d for _, d in results)


def check_real_tensor_parallel(device, dtype, sizes) -> tuple[str, str]:
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return "skipped", "needs 2 GPUs (tests/gpu/test_parallel.py runs the packaged 0.5B over two gloo ranks)"
    name = real_model((REAL_MODEL_LONG,))  # 14 query / 2 KV heads: they divide by 2
    if name is None:
        return "skipped", NOT_ASSEMBLED.replace("smollm2-135m", REAL_MODEL_LONG)
    engine = real_engine(device, name)
    doc = real_doc(sizes.n_doc_tokens, engine.target.config.vocab_size)
    one = answer(engine, "plain", doc)
    del engine
    leader = real_engine(device, name, n_gpus=2)
    try:
        two = answer(leader, "plain", doc)
    finally:
        leader.close()
    return same_tokens(two, one, f"{name}: 2 ranks (NCCL) vs one process")


def planned_vs_peak(device, make_engine: Callable[[], Engine], doc: list[int]) -> tuple[str, str]:
    """The plan for one open document and its chat against CUDA's peak allocation for them."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    engine = make_engine()
    weights = torch.cuda.memory_allocated(device) - before
    torch.cuda.reset_peak_memory_stats(device)
    answer(engine, engine.config.levels, doc)
    measured = torch.cuda.max_memory_allocated(device) - before
    n_tokens = len(doc) + CHAT_CAPACITY_TOKENS  # the capacity Engine.open allocates
    budget = [DeviceBudget(str(device), free_memory_bytes(device) + weights, "cuda")]
    draft = engine.draft.config if engine.draft is not None else None
    work = Workload(engine.dtype.itemsize, draft, engine.config.retrieval.budget_tokens, engine.config.retrieval,
                    engine.prefill_chunk_tokens, has_tail_masks=engine.attend is not attention.flash_attention,
                    n_logit_rows=engine.config.gamma_limit + 1)
    planned = plan_memory(engine.target.config, n_tokens, budget, work).devices[0].total_bytes
    ok = measured <= planned
    return ("pass" if ok else "fail"), (f"peak {measured / 2**20:.1f} MiB measured, {planned / 2**20:.1f} MiB "
                                        "planned (weights + caches + activations)")


def check_real_planner(device, dtype, sizes) -> tuple[str, str]:
    if device.type != "cuda":
        return "skipped", "needs CUDA (compares the plan with torch.cuda.max_memory_allocated)"
    name = real_model()
    if name is None:
        return "skipped", NOT_ASSEMBLED
    make = functools.partial(real_engine, device, name, dtype="auto", levels="ngram>retrieval>full")
    doc = real_doc(sizes.n_doc_tokens, 1000)
    status, detail = planned_vs_peak(device, make, doc)
    return status, f"{name} (its real shapes), {len(doc):,} tokens: {detail}"


def check_speed(device, dtype, sizes) -> tuple[str, str, list[dict]]:
    """Plain decoding and the default stack at each length: ms per token, prefill tokens/s.
    Timings, not a check: it fails only if a run fails."""
    name = real_model((REAL_MODEL_LONG,)) or real_model()
    if name is None:
        return "skipped", NOT_ASSEMBLED, []
    engine = real_engine(device, name, dtype="auto", levels="auto")
    default, rows = engine.config.levels, []
    sampling = SamplingConfig(max_new_tokens=sizes.n_new_tokens)
    for n_tokens in sizes.speed_tokens:
        if n_tokens + CHAT_CAPACITY_TOKENS > engine.max_context:
            continue
        doc = real_doc(n_tokens, engine.target.config.vocab_size)
        started = time.perf_counter()
        session = engine.open(doc)
        prefill_s = time.perf_counter() - started
        row = {"model": name, "n_tokens": n_tokens, "prefill_tokens_per_s": round(n_tokens / prefill_s, 1)}
        for levels in ("plain", default):
            session.set_levels(levels)
            events = list(session.ask(real_doc(8, 1000, seed=1), sampling))
            row[f"{'plain' if levels == 'plain' else 'stack'}_ms_per_token"] = round(events[-1].stats.tbt_ms_mean, 1)
        row["stack"] = default
        rows.append(row)
        del session  # its cache, before the next length's
    detail = "; ".join(f"{r['n_tokens']:,} tokens: prefill {r['prefill_tokens_per_s']:.0f} tokens/s, plain "
                       f"{r['plain_ms_per_token']:.1f} ms/token, {default} {r['stack_ms_per_token']:.1f}" for r in rows)
    return "pass", f"{name} ({engine.dtype}): {detail}", rows


CHECKS: dict[str, Callable] = {
    "flash-attn vs SDPA": check_flash_attn,
    "CUDA graphs vs eager": check_cuda_graphs,
    "offload vs on chip": check_offload,
    "tensor parallel vs one process": check_tensor_parallel,
    "planner vs measured peak": check_planner,
    "packaged GGUF: stacks and offload vs plain": check_real_gguf,
    "packaged GGUF: tensor parallel": check_real_tensor_parallel,
    "packaged GGUF: planner vs measured peak": check_real_planner,
    "speed: plain vs default stack": check_speed,
}


def run_checks(device: torch.device, names: list[str] | None = None, sizes: Sizes = Sizes()) -> list[Check]:
    """Each check (all, or `names`), timed; an exception is a failure with its last lines."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n_threads = torch.get_num_threads()
    results = []
    if device.type == "cpu":
        torch.set_num_threads(1)  # tiny matrices: threads only spin (and the ranks have one each)
    try:
        for name, check in CHECKS.items():
            if names and name not in names:
                continue
            started, rows = time.perf_counter(), []
            try:
                status, detail, *rows = check(device, dtype, sizes)
            except Exception as error:  # noqa: BLE001 (a crash is the finding: report it and go on)
                status = "fail"
                detail = f"{type(error).__name__}: {error} | " + " ".join(traceback.format_exc().splitlines()[-4:])
            results.append(Check(name, status, time.perf_counter() - started, detail, rows[0] if rows else []))
    finally:
        torch.set_num_threads(n_threads)
    return results


def environment(device: torch.device) -> dict:
    """What a bug report needs besides the results."""
    info = {"python": platform.python_version(), "platform": platform.platform(), "torch": torch.__version__,
            "device": str(device), "cuda": torch.version.cuda, "gpus": []}
    if device.type == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        import flash_attn
        info["flash_attn"] = flash_attn.__version__
    except ImportError:
        info["flash_attn"] = None
    return info


def report(results: list[Check], device: torch.device) -> dict:
    return {"environment": environment(device), "checks": [asdict(r) for r in results],
            "passed": all(r.status != "fail" for r in results)}


def table(results: list[Check]) -> list[str]:
    width = max(len(r.name) for r in results)
    lines = [f"{'check':<{width}}  result   seconds  detail"]
    lines += [f"{r.name:<{width}}  {r.status:<7}  {r.seconds:7.1f}  {r.detail}" for r in results]
    for r in (r for r in results if r.rows):
        lines += ["", f"{r.name}: {r.rows[0]['model']}", "  tokens  prefill tokens/s  plain ms/token  stack ms/token"]
        lines += [f"{row['n_tokens']:8,}  {row['prefill_tokens_per_s']:16.1f}  {row['plain_ms_per_token']:14.1f}  "
                  f"{row['stack_ms_per_token']:14.1f}  ({row['stack']})" for row in r.rows]
    return lines
