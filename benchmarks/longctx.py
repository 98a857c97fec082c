"""CPU long-context benchmark: our level stacks side by side with Hugging Face transformers (issue 7).

One process, one run. The committed sample book (assets/persuasion.txt) is cut to each context
length and wrapped exactly as the app does (tools/chat.py: `document_ids` + `question_ids`).
Each context is prefilled ONCE per implementation: ours with `Engine.open` (then `Session.save`,
and `Engine.restore` before every method), Hugging Face with one forward into a DynamicCache
(deep-copied before every method; restoring and copying happen outside every measurement, after
a warm-up of both implementations). Every method then answers the same questions with the same
settings, greedy and sampled. Timing is wall clock around the token stream (a streamer for HF,
the event stream for ours): TTFT covers the question's prefill and the first check; TBT is decode
only. The floor is one plain full-model step: max(bytes read / memory bandwidth, FLOPs / peak
matmul rate), both measured at start-up in this process (benchmarks/hardware.py); each answer
also records the load average and the read bandwidth just before it, since a shared host's
bandwidth changes between runs without showing in the load. Answers are
"copy-heavy" when half their tokens lie in 8-token runs of the book; the summary table groups
runs by the regime of their own answer. Both implementations share the process, so memory is
reported as each one's estimated peak alone (weights + cache + the increase while it ran).
`ours:plain@sdpa` is our plain stack on torch SDPA instead of the compiled CPU attention kernel.

    python -m benchmarks.longctx --model qwen2.5-coder-0.5b --contexts 8192,16384,32768 --new-tokens 128
    python -m benchmarks.longctx --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b --contexts 16384
    python -m benchmarks.longctx --quick                                     # CI smoke test
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import math
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import psutil
import torch

from benchmarks.cli import add_common_args
from benchmarks.hardware import RssSampler, measure_hardware, read_gb_s, token_floor
from engine.attention import pick_attention, sdpa_attention
from engine.config import EngineConfig, SamplingConfig
from engine.device import cpu_flags, pick_dtype
from engine.models import resolve_model
from engine.session import Engine, Session
from tools.chat import ChatFormat

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "assets" / "persuasion.txt"
QUESTIONS = (
    ("summary", "Summarize the story so far in one paragraph."),
    ("fact", "What is the name of Sir Walter Elliot's estate, and which book does he like to read?"),
)
HF_METHODS = ("hf:plain", "hf:prompt-lookup", "hf:assisted")
OUR_METHODS = ("ours:plain", "ours:plain@sdpa", "ours:ngram>full", "ours:retrieval>full",
               "ours:ngram>retrieval>full", "ours:draft>full", "ours:draft>retrieval>full")
SAMPLINGS = {"greedy": (0.0, 1.0), "sampled": (0.6, 0.9)}  # temperature, top_p
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value
COPY_NGRAM = 8  # an answer token is "copied" when it lies in an 8-token run found in the book
COPY_HEAVY_SHARE = 0.5
WARM_UP_TOKENS = 700  # one full prefill chunk and a partial one


def needs_draft(method: str) -> bool:
    return "draft" in method or "assisted" in method


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.longctx", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "longctx")
    p.add_argument("--draft", default=None, help="draft model: enables hf:assisted and ours:draft>...")
    p.add_argument("--contexts", default="8192,16384,32768", help="comma-separated token counts")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--samplings", default="greedy,sampled")
    p.add_argument("--questions", default="summary,fact")
    p.add_argument("--methods", default=None, help="comma-separated subset (default: all that apply)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                   help="both implementations; auto = the engine's choice (bf16 with AMX or AVX512-BF16, else float32)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="CI smoke test: SmolLM2, ~1K context, 16 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.draft, args.contexts, args.new_tokens = "smollm2-135m", None, "1024", 16
        args.samplings, args.questions = "greedy", "summary"
        args.methods = args.methods or "hf:plain,hf:prompt-lookup,ours:plain,ours:ngram>retrieval>full"
    all_methods = [m for m in HF_METHODS + OUR_METHODS if args.draft or not needs_draft(m)]
    args.methods = args.methods.split(",") if args.methods else all_methods
    unknown = set(args.methods) - set(HF_METHODS + OUR_METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; choose from {HF_METHODS + OUR_METHODS}")
    if not args.draft and any(needs_draft(m) for m in args.methods):
        p.error("hf:assisted and ours:draft>... need --draft")
    args.contexts = [int(n) for n in args.contexts.split(",")]
    return args


# ---------------------------------------------------------------- prompts

def book_doc_ids(chat: ChatFormat, book_ids: list[int], n_tokens: int) -> list[int]:
    """The app's document ids for the first part of the book, about `n_tokens` long in total."""
    overhead = len(chat.document_ids("x")) - 1
    text = chat.tokenizer.decode(book_ids[: n_tokens - overhead])
    return chat.document_ids(text)


def copy_share(answer: list[int], doc_grams: set[tuple[int, ...]]) -> float:
    """Share of answer tokens inside a run of COPY_NGRAM tokens that occurs verbatim in the book."""
    covered = [False] * len(answer)
    for i in range(len(answer) - COPY_NGRAM + 1):
        if tuple(answer[i:i + COPY_NGRAM]) in doc_grams:
            covered[i:i + COPY_NGRAM] = [True] * COPY_NGRAM
    return sum(covered) / len(answer) if answer else 0.0


# ---------------------------------------------------------------- timing

def timing(t_start: float, events: list[tuple[float, int]]) -> dict:
    """TTFT, median / mean decode TBT from (time, n_tokens) of each emission after the prompt."""
    events = [(t, n) for t, n in events if n]
    if not events:
        return {"n_tokens": 0, "ttft_s": None, "tbt_ms_median": None, "tbt_ms_mean": None, "tokens_per_s": None}
    per_token_ms = []
    for (t0, _), (t1, n) in zip(events, events[1:]):
        per_token_ms += [1000 * (t1 - t0) / n] * n
    n_total = sum(n for _, n in events)
    n_decode = n_total - events[0][1]
    mean_ms = 1000 * (events[-1][0] - events[0][0]) / n_decode if n_decode else None
    return {"n_tokens": n_total, "ttft_s": events[0][0] - t_start,
            "tbt_ms_median": statistics.median(per_token_ms) if per_token_ms else None,
            "tbt_ms_mean": mean_ms, "tokens_per_s": 1000 / mean_ms if mean_ms else None,
            "total_s": events[-1][0] - t_start}


class TimingStreamer:
    """transformers streamer that timestamps every put after the prompt's."""

    def __init__(self):
        self.events: list[tuple[float, int]] = []
        self.tokens: list[int] = []
        self.has_prompt = False

    def put(self, value: torch.Tensor) -> None:
        t = time.perf_counter()
        if not self.has_prompt:
            self.has_prompt = True
            return
        ids = value.flatten().tolist()
        self.tokens += ids
        self.events.append((t, len(ids)))

    def end(self) -> None:
        pass


# ---------------------------------------------------------------- Hugging Face

def load_hf(name: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype, attn_implementation="sdpa",
                                                 local_files_only=True).eval()
    first_step_skips_cached(model)
    return model


def hf_prefill(model, doc_ids: list[int]):
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([doc_ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def first_step_skips_cached(model) -> None:
    """Work around transformers 5.23 assisted decoding (prompt lookup, assistant model) ignoring a
    prefilled cache: its first iteration feeds the whole prompt (`next_sequence_length=None`), so
    the cached document is appended a second time at wrong positions. Feed only the uncached part,
    as plain `generate` does in `_prefill`. Applied to the target model object only."""
    original = model.prepare_inputs_for_generation

    def prepare(input_ids, next_sequence_length=None, past_key_values=None, is_first_iteration=False, **kwargs):
        if is_first_iteration and next_sequence_length is None and past_key_values is not None:
            next_sequence_length = input_ids.shape[1] - past_key_values.get_seq_length()
        return original(input_ids, next_sequence_length=next_sequence_length, past_key_values=past_key_values,
                        is_first_iteration=is_first_iteration, **kwargs)

    model.prepare_inputs_for_generation = prepare


def hf_generate(method: str, model, draft, cache, prompt: list[int], stop_ids: set[int],
                temperature: float, top_p: float, new_tokens: int, seed: int, pad_id: int) -> dict:
    """One answer with `generate`, continuing `cache` (a copy of the prefilled document's, consumed)."""
    from transformers import GenerationConfig

    settings = dict(max_new_tokens=new_tokens, eos_token_id=sorted(stop_ids), pad_token_id=pad_id,
                    do_sample=temperature > 0, repetition_penalty=1.0)
    if temperature > 0:
        settings.update(temperature=temperature, top_p=top_p, top_k=0)  # 0: no top-k, as SamplingConfig
    if method == "hf:prompt-lookup":
        settings["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
    streamer = TimingStreamer()
    extra = {"assistant_model": draft} if method == "hf:assisted" else {}
    torch.manual_seed(seed)
    t_start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                       past_key_values=cache, generation_config=GenerationConfig(**settings),
                       streamer=streamer, **extra)
    return {**timing(t_start, streamer.events), "tokens": streamer.tokens}


# ---------------------------------------------------------------- ours

def ours_session(method: str, engine: Engine, state_path: Path) -> Session:
    """The prefilled document restored from its snapshot, with the method's level stack."""
    levels, _, kernel = method.removeprefix("ours:").partition("@")
    attend = sdpa_attention if kernel == "sdpa" else pick_attention(
        engine.device, engine.config.use_flash_attn, engine.config.use_cpu_kernel)
    for model in (engine.target, engine.draft):  # "@sdpa": the same stack on torch's attention
        if model is not None:
            model.set_attention(attend)
    session = engine.restore(state_path)
    session.set_levels(levels)
    return session


def ours_generate(session: Session, q_ids: list[int], stop_ids: set[int],
                  temperature: float, top_p: float, new_tokens: int, seed: int) -> dict:
    """One answer from a restored session (consumed)."""
    sampling = SamplingConfig(temperature=temperature, top_p=top_p, max_new_tokens=new_tokens, seed=seed)
    tokens, events, last = [], [], None
    t_start = time.perf_counter()
    for event in session.ask(q_ids, sampling, stop_ids=stop_ids):
        events.append((time.perf_counter(), len(event.tokens)))
        tokens += event.tokens
        last = event
    result = {**timing(t_start, events), "tokens": tokens}
    result["levels"] = level_breakdown(last.stats, result)
    return result


def level_breakdown(stats, result: dict) -> list[dict]:
    """Acceptance, tokens per check and share of the answer's wall time, per level.

    "below" is the time spent under the lowest checking level: the bottom drafter (n-gram lookup
    or draft model) and the retrieval cache's syncs and rebuilds. "other" is the rest: the
    question's prefill, the loop and the event builder.
    """
    total = result.get("total_s") or 1e-9
    rows = [{"level": s.name, "n_checks": s.n_checks, "acceptance": s.acceptance,
             "tokens_per_check": s.tokens_per_check, "time_s": s.time_s, "share": s.time_s / total}
            for s in stats.levels]
    middle_s = sum(s.time_s for s in stats.levels[:-1])
    below_s = max(0.0, stats.drafter_s - middle_s)
    rows.append({"level": "below", "time_s": below_s, "share": below_s / total})
    other_s = total - below_s - sum(s.time_s for s in stats.levels)
    rows.append({"level": "other", "time_s": other_s, "share": other_s / total})
    return rows


# ---------------------------------------------------------------- the run

def machine() -> dict:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    return {"cpu": cpu, "amx_bf16": "amx_bf16" in cpu_flags(), "avx512_bf16": "avx512_bf16" in cpu_flags(),
            "n_cores": psutil.cpu_count(),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": __import__("transformers").__version__,
            "load_avg_at_start": list(psutil.getloadavg())}


def run_context(args, n_ctx, engine, hf_model, hf_draft, chat, book_ids, hw, report, save):
    room = 64 + args.new_tokens  # the question and the answer must fit in the model's context too
    if n_ctx + room > engine.max_context:
        log(f"context {n_ctx:,} leaves no room for the question and answer: using {engine.max_context - room:,}")
        n_ctx = engine.max_context - room
    doc_ids = book_doc_ids(chat, book_ids, n_ctx)
    doc_grams = {tuple(doc_ids[i:i + COPY_NGRAM]) for i in range(len(doc_ids) - COPY_NGRAM + 1)}
    floor = token_floor(engine.target, len(doc_ids), hw)
    kv_mib = engine.target.config.kv_bytes_per_token(engine.dtype.itemsize) * len(doc_ids) / 2**20
    ctx = {"n_doc_tokens": len(doc_ids), "floor": {**floor.__dict__, "ms": floor.ms}, "kv_mib": kv_mib,
           "runs": []}
    report["contexts"].append(ctx)
    log(f"context {len(doc_ids):,} tokens; floor {floor.ms:.1f} ms/token "
        f"(bytes {floor.bytes_ms:.1f} ms, FLOPs {floor.flops_ms:.1f} ms)")
    needs_hf = any(m.startswith("hf:") for m in args.methods)
    with tempfile.TemporaryDirectory() as tmp:
        state_path = Path(tmp) / "prefill.pt"
        gc.collect()
        with RssSampler() as rss:
            t0 = time.perf_counter()
            session = engine.open(doc_ids)
            ours_s = time.perf_counter() - t0
        session.save(state_path)
        del session
        ctx["prefill"] = {"ours_s": ours_s, "ours_tokens_per_s": len(doc_ids) / ours_s,
                          "ours_rss_delta_mib": rss.delta_bytes / 2**20}
        log(f"  ours prefill {ours_s:.1f} s ({len(doc_ids) / ours_s:.0f} tokens/s)")
        gc.collect()
        hf_cache = None
        if needs_hf:
            with RssSampler() as rss:
                t0 = time.perf_counter()
                hf_cache = hf_prefill(hf_model, doc_ids)
                hf_s = time.perf_counter() - t0
            ctx["prefill"].update(hf_s=hf_s, hf_tokens_per_s=len(doc_ids) / hf_s,
                                  hf_rss_delta_mib=rss.delta_bytes / 2**20)
            log(f"  HF prefill {hf_s:.1f} s ({len(doc_ids) / hf_s:.0f} tokens/s)")
        save()
        for q_name in args.questions.split(","):
            q_ids = chat.question_ids(dict(QUESTIONS)[q_name], is_first=True, previous_answer_ended=False)
            for s_name in args.samplings.split(","):
                temperature, top_p = SAMPLINGS[s_name]
                refs: dict[str, dict] = {}
                for method in args.methods:
                    # restoring the snapshot / copying the cache is the harness's work: not measured
                    if method.startswith("hf:"):
                        prepared = copy.deepcopy(hf_cache)
                    else:
                        prepared = ours_session(method, engine, state_path)
                    gc.collect()
                    load_avg, bandwidth = psutil.getloadavg()[0], read_gb_s()
                    with RssSampler() as rss:
                        if method.startswith("hf:"):
                            r = hf_generate(method, hf_model, hf_draft, prepared, doc_ids + q_ids, chat.stop_ids,
                                            temperature, top_p, args.new_tokens, args.seed,
                                            chat.tokenizer.pad_token_id or 0)
                        else:
                            r = ours_generate(prepared, q_ids, chat.stop_ids, temperature, top_p,
                                              args.new_tokens, args.seed)
                    del prepared
                    r.update(method=method, question=q_name, sampling=s_name, peak_rss_mib=rss.peak_bytes / 2**20,
                             rss_delta_mib=rss.delta_bytes / 2**20, load_avg_1min=load_avg,
                             read_gb_s=bandwidth,
                             copy_share=copy_share(r["tokens"], doc_grams))
                    r["is_copy_heavy"] = r["copy_share"] >= COPY_HEAVY_SHARE
                    r["floor_ratio"] = r["tbt_ms_mean"] / floor.ms if r["tbt_ms_mean"] else None
                    refs[method] = r
                    compare(r, refs.get("hf:plain"), refs.get("hf:prompt-lookup"), s_name)
                    r["text"] = chat.tokenizer.decode(r["tokens"], skip_special_tokens=True)
                    ctx["runs"].append(r)
                    log("  " + one_line(r))
                    save()
        del hf_cache
        gc.collect()
    ctx["memory"] = memory_estimate(report["memory_base"], ctx)


def memory_estimate(base: dict, ctx: dict) -> dict:
    """Peak RSS each implementation would need alone: the process baseline (torch, no model) + its
    weights + max(prefill increase, KV + largest increase while answering). Both implementations
    share this process, so their raw peaks include each other's weights and caches; the increases
    (peak minus RSS just before) do not."""
    out = {}
    for impl in ("ours", "hf"):
        prefill = ctx["prefill"].get(f"{impl}_rss_delta_mib")
        if prefill is None:
            continue
        decode = max((r["rss_delta_mib"] for r in ctx["runs"] if r["method"].startswith(impl + ":")), default=0.0)
        work = max(prefill, ctx["kv_mib"] + decode)
        out[impl] = {"weights_mib": base[f"{impl}_weights_mib"], "prefill_delta_mib": prefill,
                     "answer_delta_mib": decode, "peak_mib": base["process_mib"] + base[f"{impl}_weights_mib"] + work}
    return out


def compare(r: dict, plain: dict | None, lookup: dict | None, s_name: str) -> None:
    """Speedups against HF plain decoding and HF prompt lookup of the same question and sampling;
    for greedy, where the tokens first differ from HF plain (None: identical)."""
    for name, ref in (("speedup_vs_hf_plain", plain), ("speedup_vs_hf_prompt_lookup", lookup)):
        if ref is not None and ref["tbt_ms_mean"] and r["tbt_ms_mean"]:
            r[name] = ref["tbt_ms_mean"] / r["tbt_ms_mean"]
    if s_name == "greedy" and plain is not None:
        a, b = r["tokens"], plain["tokens"]
        n = min(len(a), len(b))
        diverge = next((i for i in range(n) if a[i] != b[i]), None if len(a) == len(b) else n)
        r["equals_hf_plain"] = diverge is None
        r["diverges_at"] = diverge


def fmt(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else "–"


def one_line(r: dict) -> str:
    levels = " ".join(f"{lv['level']}:a={lv['acceptance']:.2f},t/c={lv['tokens_per_check']:.2f},{lv['share']:.0%}"
                      if "acceptance" in lv else f"{lv['level']}:{lv['share']:.0%}" for lv in r.get("levels", []))
    eq = {True: "same", False: f"differs@{r.get('diverges_at')}", None: ""}[r.get("equals_hf_plain")]
    return (f"{r['question']:7} {r['sampling']:7} {r['method']:27} n={r['n_tokens']:3} ttft={fmt(r['ttft_s'], '.2f')}s "
            f"tbt={fmt(r['tbt_ms_median'], '.1f')}/{fmt(r['tbt_ms_mean'], '.1f')}ms "
            f"x{fmt(r.get('speedup_vs_hf_plain'), '.2f')} (PLD x{fmt(r.get('speedup_vs_hf_prompt_lookup'), '.2f')}) "
            f"floor x{fmt(r['floor_ratio'], '.2f')} copy={r['copy_share']:.0%} +rss={r['rss_delta_mib']:.0f}MiB "
            f"load={r['load_avg_1min']:.1f} read={r['read_gb_s']:.1f}GB/s {eq} {levels}")


def regime(r: dict) -> str:
    """"copy-heavy" or "abstractive", judged on the run's own answer (sampled answers differ
    between methods). HF plain's time per token does not depend on what it writes, so the
    speedups stay comparable across regimes; HF prompt lookup's does."""
    return "copy-heavy" if r["is_copy_heavy"] else "abstractive"


def geomean(xs: list[float]) -> float | None:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def summary_rows(report: dict) -> list[str]:
    """Per context, sampling and regime: each method's mean TBT and geometric-mean speedups."""
    rows = ["| context | sampling | answers | method | runs | TBT mean ms | vs HF plain | vs HF prompt lookup |",
            "|---|---|---|---|---:|---:|---:|---:|"]
    for ctx in report["contexts"]:
        groups: dict[tuple, list[dict]] = {}
        for r in ctx["runs"]:
            groups.setdefault((r["sampling"], regime(r), r["method"]), []).append(r)
        for (s_name, kind, method), runs in sorted(groups.items(), key=lambda g: g[0][:2]):  # stable: method order
            tbts = [r["tbt_ms_mean"] for r in runs if r["tbt_ms_mean"]]
            plain = geomean([r["speedup_vs_hf_plain"] for r in runs if r.get("speedup_vs_hf_plain")])
            pld = geomean([r["speedup_vs_hf_prompt_lookup"] for r in runs if r.get("speedup_vs_hf_prompt_lookup")])
            rows.append(f"| {ctx['n_doc_tokens'] / 1024:.0f}K | {s_name} | {kind} | `{method}` | {len(runs)} "
                        f"| {fmt(sum(tbts) / len(tbts) if tbts else None, '.1f')} | {fmt(plain, '.2f')}× "
                        f"| {fmt(pld, '.2f')}× |")
    return rows


def markdown(report: dict) -> str:
    pre = ["| context | floor ms/token (bytes / FLOPs) | ours prefill tokens/s | HF prefill tokens/s "
           "| est. peak RSS alone, ours / HF MiB |",
           "|---:|---|---:|---:|---|"]
    for ctx in report["contexts"]:
        fl, p, m = ctx["floor"], ctx.get("prefill", {}), ctx.get("memory", {})
        rss = " / ".join(fmt(m.get(impl, {}).get("peak_mib"), ".0f") for impl in ("ours", "hf"))
        pre.append(f"| {ctx['n_doc_tokens']:,} | {fl['ms']:.1f} ({fl['bytes_ms']:.1f} / {fl['flops_ms']:.1f}) "
                   f"| {fmt(p.get('ours_tokens_per_s'), '.0f')} | {fmt(p.get('hf_tokens_per_s'), '.0f')} | {rss} |")
    head = ("| context | question | sampling | method | tokens | copy | TTFT s | TBT median ms | TBT mean ms "
            "| tokens/s | vs HF plain | vs HF PLD | TBT/floor | = HF plain "
            "| levels: acceptance, tokens/check, time share | +RSS MiB | load | read GB/s |\n"
            "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|")
    rows = [head]
    for ctx in report["contexts"]:
        for r in ctx["runs"]:
            levels = "; ".join(
                f"{lv['level']} {lv['acceptance']:.2f}, {lv['tokens_per_check']:.2f}, {lv['share']:.0%}"
                if "acceptance" in lv else f"{lv['level']} {lv['share']:.0%}" for lv in r.get("levels", []))
            eq = {True: "yes", False: f"no (token {r.get('diverges_at')})", None: ""}[r.get("equals_hf_plain")]
            copy_label = f"{r['copy_share']:.0%}" + (" copy-heavy" if r["is_copy_heavy"] else "")
            rows.append(f"| {ctx['n_doc_tokens']:,} | {r['question']} | {r['sampling']} | `{r['method']}` "
                        f"| {r['n_tokens']} | {copy_label} | {fmt(r['ttft_s'], '.2f')} "
                        f"| {fmt(r['tbt_ms_median'], '.1f')} | {fmt(r['tbt_ms_mean'], '.1f')} "
                        f"| {fmt(r['tokens_per_s'], '.2f')} | {fmt(r.get('speedup_vs_hf_plain'), '.2f')}× "
                        f"| {fmt(r.get('speedup_vs_hf_prompt_lookup'), '.2f')}× | {fmt(r['floor_ratio'], '.2f')} "
                        f"| {eq} | {levels} | {r['rss_delta_mib']:.0f} | {r['load_avg_1min']:.1f} "
                        f"| {r['read_gb_s']:.1f} |")
    return "\n".join(pre) + "\n\n" + "\n".join(summary_rows(report)) + "\n\n" + "\n".join(rows) + "\n"


def warm_up(engine: Engine, hf_model, ids: list[int]) -> None:
    """One short prefill and a few decoding steps per implementation, so one-time costs (kernel
    selection, oneDNN primitive creation, first allocations) fall outside every measurement."""
    session = engine.open(ids[:-8])
    for _ in session.ask(ids[-8:], SamplingConfig(max_new_tokens=4)):
        pass
    if hf_model is not None:
        cache = hf_prefill(hf_model, ids)
        with torch.no_grad():
            hf_model.generate(input_ids=torch.tensor([ids + ids[:1]]), past_key_values=cache, max_new_tokens=4,
                              do_sample=False, pad_token_id=0)


def weights_mib(*models) -> float:
    """Bytes of the distinct parameter tensors of the given models (tied embeddings counted once;
    a packed LM head is a copy, engine/model.py `PackedLinear`)."""
    params = {id(p): p for m in models if m is not None for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in params.values()) / 2**20


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = pick_dtype(args.dtype, torch.device("cpu"))  # what the engine picks for "auto"
    args.dtype = str(dtype).removeprefix("torch.")
    hw = measure_hardware(n_repeats=1 if args.quick else 5, copy_mib=64 if args.quick else 512, dtypes=(dtype,))
    log(f"copy {hw.copy_gb_s:.1f} GB/s; read {hw.read_gb_s:.1f} GB/s; matmul {hw.matmul_tflops}; "
        f"decode matmuls {hw.decode_matmul_ms}")
    gc.collect()
    process_mib = psutil.Process().memory_info().rss / 2**20  # torch loaded, no model yet
    levels = "draft>retrieval>full" if args.draft else "ngram>retrieval>full"
    engine = Engine.load(EngineConfig(target=args.model, draft=args.draft, levels=levels, dtype=args.dtype))
    needs_hf = any(m.startswith("hf:") for m in args.methods)
    hf_model = load_hf(args.model, dtype) if needs_hf else None
    hf_draft = load_hf(args.draft, dtype) if "hf:assisted" in args.methods else None
    memory_base = {"process_mib": process_mib, "ours_weights_mib": weights_mib(engine.target, engine.draft),
                   "hf_weights_mib": weights_mib(hf_model, hf_draft)}
    chat = ChatFormat(engine.tokenizer)
    book_ids = chat._user_text(BOOK.read_text(encoding="utf-8-sig").strip())
    warm_up(engine, hf_model, book_ids[:WARM_UP_TOKENS])
    report = {"command": "python -m benchmarks.longctx " + " ".join(sys.argv[1:] if argv is None else argv),
              "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(),
              "settings": {"model": args.model, "draft": args.draft, "dtype": args.dtype, "threads": args.threads,
                           "new_tokens": args.new_tokens, "seed": args.seed, "methods": args.methods,
                           "questions": {q: dict(QUESTIONS)[q] for q in args.questions.split(",")},
                           "samplings": {s: SAMPLINGS[s] for s in args.samplings.split(",")},
                           "prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS,
                           "engine": dataclasses.asdict(engine.config)},
              "hardware": hw.to_json(), "memory_base": memory_base, "contexts": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(report))

    for n_ctx in args.contexts:
        run_context(args, n_ctx, engine, hf_model, hf_draft, chat, book_ids, hw, report, save)
    report["max_rss_mib"] = psutil.Process().memory_info().rss / 2**20
    save()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
