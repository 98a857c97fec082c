"""The GPU paths at the mission's shapes, with random weights: a benchmark for a lent GPU.

No checkpoint can reach a GPU machine without a network, so this builds random models in the
shapes of the README's 4090 pair (Llama-3.1-8B target, Llama-3.2-1B draft, bfloat16) and runs
the engine's own GPU paths at 32K and 128K tokens: the prefill, plain decoding and the stacks
`retrieval>full` and `draft>retrieval>full`, with the full cache on the chip and offloaded to
pinned host memory with `--resident` layers kept on the GPU (the planner's count for one 24 GB
4090 at 128K, README "Running on GPUs"). It reports what a GPU run can tell about the product:
- whether each path runs at these sizes (the offloaded 128K path is the one a review found
  would crash or refuse);
- each stack's greedy tokens against plain decoding's (bfloat16: agreement is reported, not
  required; docs/ALGORITHM.md section 1), and the offloaded cache's against the on-chip one's;
- prefill tokens/s and ms per token. With random weights the drafts' acceptance says nothing
  about a real model's, so the stacks' times are not the product's speed-ups; plain decoding's
  time is the weights' and the cache's bytes over the chip's (or the host link's) bandwidth
  whatever the weights, which is what benchmarks/cost_model.py predicts.

    python -m benchmarks.gpu_shapes --lengths 32768,131072 --out results/gpu_shapes.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import LlamaConfig

from engine.config import EngineConfig, ModelConfig, SamplingConfig
from engine.model import Transformer
from engine.session import Engine

# published configs (hidden, layers, heads, KV heads, MLP); vocabulary 128,256, RoPE base 500,000
SHAPES = {"llama-8b": (4096, 32, 32, 8, 14336), "llama-1b": (2048, 16, 32, 8, 8192),
          "tiny": (256, 4, 4, 2, 512)}  # --small: a CPU dry run of this script
STACKS = ("plain", "retrieval>full", "draft>retrieval>full")


def random_model(shape: str, max_positions: int, device: torch.device, seed: int,
                 dtype: torch.dtype = torch.bfloat16) -> Transformer:
    dim, n_layers, n_heads, n_kv_heads, mlp = SHAPES[shape]
    hf = LlamaConfig(vocab_size=128256, hidden_size=dim, intermediate_size=mlp, num_hidden_layers=n_layers,
                     num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, rope_theta=500000.0,
                     max_position_embeddings=max_positions, bos_token_id=None, eos_token_id=None,
                     pad_token_id=None)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(ModelConfig.from_hf(hf), hf)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.03)  # peaked enough that greedy tokens are no near-ties
    return model.to(dtype).eval()


def document(n_tokens: int, seed: int = 0) -> list[int]:
    """Random ids with a repeated passage (something for the retrieval level to find)."""
    g = torch.Generator().manual_seed(seed)
    part = torch.randint(0, 128000, (n_tokens // 4,), generator=g).tolist()
    rest = torch.randint(0, 128000, (n_tokens - 2 * len(part),), generator=g).tolist()
    return rest + part + part


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def first_difference(got: list[int], want: list[int]) -> int | None:
    if got == want:
        return None
    return next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))


def run_length(engine: Engine, n_tokens: int, n_new: int, reference: list[int] | None) -> dict:
    """Prefill, then each stack's greedy answer to one question, timed, against plain's tokens."""
    doc = document(n_tokens)
    sync(engine.device)
    started = time.perf_counter()
    session = engine.open(doc)
    sync(engine.device)
    prefill_s = time.perf_counter() - started
    row = {"n_tokens": len(doc), "prefill_s": round(prefill_s, 2),
           "prefill_tokens_per_s": round(len(doc) / prefill_s), "stacks": {}}
    question = document(16, seed=1)[:16]
    for levels in STACKS:
        session.set_levels(levels)
        tokens, events = [], []
        for event in session.ask(question, SamplingConfig(max_new_tokens=n_new)):
            tokens += event.tokens
            events.append(event)
        stats = events[-1].stats
        session.truncate(len(doc))
        if levels == "plain":
            plain = tokens
        row["stacks"][levels] = {
            "ms_per_token": round(stats.tbt_ms_mean, 2), "ttft_s": round(stats.ttft_s, 3),
            "acceptance": {s.name: round(s.acceptance, 3) for s in stats.levels},
            "first_difference_from_plain": first_difference(tokens, plain),
            "kv_host_memory": stats.kv_host_memory}
    row["plain_tokens"] = plain
    if reference is not None:
        row["plain_first_difference_from_other_cache"] = first_difference(plain, reference)
    if engine.device.type == "cuda":
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    del session
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def profile_plain(engine: Engine, n_tokens: int, n_steps: int = 8) -> str:
    """torch.profiler's table of `n_steps` plain decoding steps over `n_tokens` (where a token's time goes)."""
    session = engine.open(document(n_tokens))
    question = document(16, seed=1)[:16]
    list(session.ask(question, SamplingConfig(max_new_tokens=4)))  # warm-up
    session.truncate(n_tokens)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        list(session.ask(question, SamplingConfig(max_new_tokens=n_steps)))
        sync(engine.device)
    averages = prof.key_averages()
    return "\n".join([averages.table(sort_by="cuda_time_total", row_limit=20),
                      averages.table(sort_by="cpu_time_total", row_limit=20)])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="32768,131072")
    p.add_argument("--resident", type=int, default=5, help="KV layers kept on the GPU when offloaded")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--deadline-s", type=float, default=420, help="skip what would start after this")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--offload-only", action="store_true", help="only the offloaded cache")
    p.add_argument("--profile", type=Path, help="write a profile of plain decoding at the first length here")
    p.add_argument("--small", action="store_true", help="tiny shapes on the CPU: a dry run of this script")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_shapes.json"))
    args = p.parse_args(argv)
    started = time.perf_counter()
    device = torch.device("cpu" if args.small else "cuda")
    lengths = [int(n) for n in args.lengths.split(",")]
    max_positions = max(lengths) + 4096
    dtype = getattr(torch, args.dtype)
    target = random_model("tiny" if args.small else "llama-8b", max_positions, device, 0, dtype)
    draft = random_model("tiny" if args.small else "llama-1b", max_positions, device, 1, dtype)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "none (--small)"
    report = {"gpu": gpu, "torch": torch.__version__, "shapes": SHAPES,
              "dtype": args.dtype, "resident_kv_layers": args.resident, "new_tokens": args.new_tokens, "rows": []}
    base = dict(target="random llama-8b", draft="random llama-1b", device=str(device), dtype=args.dtype,
                prefill_chunk_tokens=2048)
    # the first length on the chip, then offloaded; the longer ones offloaded first (the 4090's path)
    runs = [(n, offload) for n in lengths for offload in ((False, True) if n == lengths[0] else (True, False))]
    if args.offload_only:
        runs = [(n, True) for n in lengths]
    if args.profile:
        args.profile.write_text(profile_plain(Engine(EngineConfig(**base), target, draft=draft), lengths[0]))
    plain_tokens: dict[int, list[int]] = {}  # each length's first run: the other cache's reference
    for n_tokens, offload in runs:
        if time.perf_counter() - started > args.deadline_s:
            report["rows"].append({"n_tokens": n_tokens, "offload": offload, "skipped": "deadline"})
            continue
        config = EngineConfig(**base, offload_kv=offload, resident_kv_layers=args.resident if offload else None)
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            row = run_length(Engine(config, target, draft=draft), n_tokens, args.new_tokens,
                             plain_tokens.get(n_tokens))
        except Exception as error:  # noqa: BLE001 (a crash at this size is the finding)
            row = {"n_tokens": n_tokens, "error": f"{type(error).__name__}: {error}"}
        row["offload"] = offload
        plain_tokens.setdefault(n_tokens, row.get("plain_tokens"))
        report["rows"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "plain_tokens"}), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    report["seconds"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    return report


if __name__ == "__main__":
    main()
