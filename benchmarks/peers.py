"""llama.cpp side by side with our `plain` decoding on the same GGUF file (issue 22, item 3).

llama.cpp is what LM Studio, Ollama and Jan run underneath. Its tools are built once from the
PyPI sdist by scripts/build_llamacpp.sh (cached in ~/.cache/bookchat/llama.cpp-11434; the build
flags are recorded in the report). For each thread count and depth D:
- llama.cpp decode: `llama-bench -m FILE -d D -n 32 -p 0 -t THREADS` (32 tokens after a
  D-token context, which llama-bench prefills untimed);
- llama.cpp prefill: `llama-bench -m FILE -p D -n 0 -t THREADS` (a D-token prompt from empty);
- ours: the committed book cut to D tokens (benchmarks/longctx.py's prompt), `Engine.open`
  timed as the prefill, then `plain` greedy answers of `--new-tokens` tokens, decode TBT mean.
  Each `--dtypes` entry is a separate engine: float32 and bfloat16 load the GGUF's blocks as they
  are in the file (engine/quant.py; linears in float32, the rest of a bf16 model in bf16),
  `bfloat16-dequantized` the dequantized safetensors copy with bf16 kernels (the default on
  AVX512-BF16 / AMX CPUs before the blocks ran in bf16 models).
Ratios are ours / llama.cpp in speed (> 1: we are faster). One run each; the machine is shared,
so the load average is recorded before every measurement. Without llama.cpp built, `--quick`
skips and a full run measures ours only (llama-bench is looked for again after each depth).

    nice -n 19 bash scripts/build_llamacpp.sh          # once (a long C++ build)
    python -m benchmarks.peers --contexts 8192 --threads 1
    python -m benchmarks.peers --quick                 # smoke test; skips when llama.cpp is absent
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

from benchmarks.cli import THREADS, add_common_args
from benchmarks.longctx import BOOK, book_doc_ids, log, machine, timing
from engine.config import PAIRED_DRAFTS, EngineConfig, Levels, SamplingConfig
from engine.files import cache_root
from engine.loading import generation_defaults, load_model
from engine.models import PACKAGED_MODELS, gguf_path
from engine.session import Engine
from tools.chat import ChatFormat

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "Summarize the story so far in one paragraph."


def llamacpp_dir() -> Path:
    return Path(os.environ.get("LLAMACPP_DIR") or cache_root() / "llama.cpp-11434")


def llama_bench(bench: Path, gguf: Path, threads: int, n_prompt: int, n_gen: int, depth: int) -> dict:
    """One llama-bench test: {"ms_per_token", "tokens_per_s", "command"} from its JSON output."""
    command = [str(bench), "-m", str(gguf), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen),
               "-d", str(depth), "-r", "1", "-o", "json"]
    env = {**os.environ, "LD_LIBRARY_PATH": str(bench.parent)}
    t0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-1000:]}")
    row = json.loads(done.stdout)[0]
    return {"tokens_per_s": row["avg_ts"], "ms_per_token": 1000 / row["avg_ts"], "wall_s": time.perf_counter() - t0,
            "command": " ".join(["llama-bench", *command[1:]]), "n_threads": row["n_threads"]}


def answer(engine: Engine, session, q_ids: list[int], n_doc: int, new_tokens: int, stack: str, quick: bool = True,
           stop_ids: set[int] | None = None) -> dict:
    """One greedy answer with level stack `stack`, built anew with the engine's settings as they
    are now (`quick`: int8 levels below the top), then the session truncated back to the book:
    decode ms/token (first event excluded), its tokens, and each checking level's counters."""
    engine.quick_drafts = quick
    session.set_levels("plain")
    session.set_levels(stack)  # built anew: set_levels keeps a stack of the same name
    events, tokens, t_start, last = [], [], time.perf_counter(), None
    for last in session.ask(q_ids, SamplingConfig(max_new_tokens=new_tokens), stop_ids=stop_ids):
        events.append((time.perf_counter(), len(last.tokens)))
        tokens += last.tokens
    session.truncate(n_doc)
    decode = timing(t_start, events)
    levels = {s.name: {"acceptance": s.acceptance, "n_tested": s.n_tested, "tokens_per_check": s.tokens_per_check,
                       "time_s": s.time_s} for s in (last.stats.levels if last else [])}
    return {"ms_per_token": decode["tbt_ms_mean"], "n_tokens": decode["n_tokens"], "tokens": tokens,
            "levels": levels, "drafter_s": last.stats.drafter_s if last else None}


def ours(engine: Engine, chat: ChatFormat, doc_ids: list[int], q_ids: list[int], new_tokens: int,
         stacks: list[str], exact_drafts: bool = False) -> dict:
    """Our prefill of the document, then one greedy answer per level stack (`plain` first), each
    from the same prefill (the session is truncated back to the book between them); with
    `exact_drafts`, each speculative stack again with exact levels below the top ("STACK exact")."""
    t0 = time.perf_counter()
    session = engine.open(doc_ids)
    prefill_s = time.perf_counter() - t0
    result = {"prefill_s": prefill_s, "prefill_tokens_per_s": len(doc_ids) / prefill_s, "stacks": {}}
    runs = [(s, True) for s in stacks if engine.has_draft or not Levels.parse(s).needs_draft]
    runs += [(s, False) for s, _ in runs if exact_drafts and s != "plain"]
    for stack, quick in runs:
        run = answer(engine, session, q_ids, len(doc_ids), new_tokens, stack, quick, chat.stop_ids)
        run["accept"] = None if stack == "plain" else run["levels"].get("full", {}).get("acceptance")
        result["stacks"][stack if quick else f"{stack} exact"] = run
    result.update(result["stacks"]["plain"])  # the table's plain column
    result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the process so far
    return result


def llama_spec(tool: Path, gguf: Path, draft: Path | None, prompt: Path, threads: int, new_tokens: int,
               n_ctx: int) -> dict:
    """llama.cpp's own speculative decoding, greedy, on the same prompt text: `llama-speculative-simple`
    with the draft model, or `llama-lookup` (n-grams of the prompt and the answer). Decode tokens/s
    and acceptance from the tool's own log."""
    command = [str(tool), "-m", str(gguf), "-f", str(prompt), "-n", str(new_tokens), "-t", str(threads),
               "-c", str(n_ctx), "-b", str(n_ctx), "-ub", "512", "--temp", "0"]  # the prompt in one batch
    command += ["-md", str(draft), "-td", str(threads), "--spec-type", "draft-simple"] if draft else []
    env = {**os.environ, "LD_LIBRARY_PATH": str(tool.parent)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-1000:]}")
    found = {key: re.search(pattern, done.stderr) for key, pattern in {
        "encoded": r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds",
        "decoded": r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds",
        "accept": r"accept\s+=\s+([\d.]+)%"}.items()}
    if not (found["encoded"] and found["decoded"]):
        raise RuntimeError(f"{tool.name}: no timing in its log: {done.stderr[-1000:]}")
    n_dec, dec_s = int(found["decoded"][1]), float(found["decoded"][2])
    return {"ms_per_token": 1000 * dec_s / n_dec, "n_tokens": n_dec,
            "prefill_tokens_per_s": int(found["encoded"][1]) / float(found["encoded"][2]),
            "accept": float(found["accept"][1]) / 100 if found["accept"] else None,
            "command": " ".join([tool.name, *command[1:]])}


def load_engine(model: str, setting: str, draft: str | None = None) -> Engine:
    """`plain` decoding of `model`: "float32" / "bfloat16" as Engine.load makes it (the GGUF's
    blocks, with `draft` if given), "DTYPE-dequantized" from the dequantized copy
    (`keep_gguf_blocks=False`, no draft)."""
    dtype, _, dequantized = setting.partition("-")
    config = EngineConfig(target=model, draft=None if dequantized else draft, levels="plain", device="cpu",
                          dtype=dtype)
    if not dequantized:
        return Engine.load(config)
    target, tokenizer = load_model(model, getattr(torch, dtype), torch.device("cpu"), keep_gguf_blocks=False)
    return Engine(config, target, tokenizer, None, generation_defaults(model, Path(tokenizer.name_or_path)))


def warm_up(engine: Engine, chat: ChatFormat, book_ids: list[int]) -> None:
    session = engine.open(book_doc_ids(chat, book_ids, 600))
    for _ in session.ask(book_ids[:8], SamplingConfig(max_new_tokens=4)):
        pass


def table(report: dict) -> str:
    head = ("| threads | depth | llama.cpp decode ms/token | " + " | ".join(
        f"ours {d} ms/token (speed ratio)" for d in report["settings"]["dtypes"])
        + " | llama.cpp prefill tokens/s | " + " | ".join(
        f"ours {d} prefill tokens/s (ratio)" for d in report["settings"]["dtypes"]) + " |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in report["runs"]:
        llama = r.get("llama.cpp") or {}
        dec, pre = llama.get("decode", {}).get("ms_per_token"), llama.get("prefill", {}).get("tokens_per_s")
        cells = [str(r["threads"]), f"{r['depth']:,}", f"{dec:.1f}" if dec else "-"]
        for d in report["settings"]["dtypes"]:
            o = r["ours"].get(d, {})
            ratio = f" ({dec / o['ms_per_token']:.2f}x)" if dec and o.get("ms_per_token") else ""
            cells.append(f"{o['ms_per_token']:.1f}{ratio}" if o.get("ms_per_token") else "-")
        cells.append(f"{pre:.0f}" if pre else "-")
        for d in report["settings"]["dtypes"]:
            o = r["ours"].get(d, {})
            ratio = f" ({o['prefill_tokens_per_s'] / pre:.2f}x)" if pre and o else ""
            cells.append(f"{o['prefill_tokens_per_s']:.0f}{ratio}" if o else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def stack_table(report: dict) -> str:
    """Every decoder on one greedy summary: ms/token and speed against llama.cpp's plain decode."""
    rows = ["| threads | depth | decoder | ms/token | speed vs llama.cpp plain | accepted (top) | accepted (middle) |",
            "|---|---|---|---:|---:|---:|---:|"]
    for r in report["runs"]:
        llama = r.get("llama.cpp") or {}
        base = llama.get("decode", {}).get("ms_per_token")
        decoders = [("llama.cpp plain", llama.get("decode"))]
        decoders += [(f"llama.cpp {k}", v) for k, v in llama.items() if k not in ("decode", "prefill")]
        decoders += [(f"ours {d} `{k}`", v) for d, o in r["ours"].items() for k, v in o.get("stacks", {}).items()]
        for name, v in decoders:
            if v:
                ratio = f"{base / v['ms_per_token']:.2f}x" if base else "-"
                accept = f"{v['accept']:.2f}" if v.get("accept") is not None else ""
                middle = v.get("levels", {}).get("retrieval", {}).get("acceptance")
                rows.append(f"| {r['threads']} | {r['depth']:,} | {name} | {v['ms_per_token']:.1f} | {ratio} "
                            f"| {accept} | {'' if middle is None else f'{middle:.2f}'} |")
    return "\n".join(rows)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "peers", threads=False)
    p.add_argument("--contexts", default="8192", help="comma-separated depths (tokens)")
    p.add_argument("--threads", default=str(THREADS), help="comma-separated thread counts")
    p.add_argument("--dtypes", default="float32,bfloat16,bfloat16-dequantized",
                   help="our engines: float32 / bfloat16 = the GGUF's blocks (engine/quant.py) in a model of that "
                        "dtype; bfloat16-dequantized = the dequantized bf16 copy")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--stacks", default="plain",
                   help="our level stacks, each answering after one prefill (plain is always measured)")
    p.add_argument("--exact-drafts", action="store_true",
                   help="each speculative stack also with exact levels below the top (no int8 activations)")
    p.add_argument("--spec", action="store_true",
                   help="also llama.cpp's speculative decoding: llama-speculative-simple with the paired draft "
                        "and llama-lookup (n-grams), on the same prompt text")
    p.add_argument("--skip-llamacpp-prefill", action="store_true", help="llama.cpp decode only (prefill is slow)")
    p.add_argument("--quick", action="store_true", help="smoke test: SmolLM2, depth 256, 8 tokens, 1 thread")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.contexts, args.threads, args.new_tokens, args.dtypes = "smollm2-135m", "256", "1", 8, "float32"
    args.contexts = [int(n) for n in args.contexts.split(",")]
    args.threads = [int(n) for n in args.threads.split(",")]
    args.dtypes = args.dtypes.split(",")
    args.stacks = ["plain"] + [x for x in args.stacks.split(",") if x and x != "plain"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gguf = gguf_path(args.model) if args.model in PACKAGED_MODELS else Path(args.model)
    bench = llamacpp_dir() / "bin" / "llama-bench"
    report = {"command": "python -m benchmarks.peers " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": machine(), "gguf": str(gguf), "runs": [],
              "settings": {"model": args.model, "dtypes": args.dtypes, "new_tokens": args.new_tokens}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    missing = [str(path) for path in (bench, gguf) if not path.is_file() and (args.quick or path == gguf)]
    if missing:
        report["skipped"] = f"not found: {', '.join(missing)} (nice -n 19 bash scripts/build_llamacpp.sh; " \
                            f"python -m tools.models --only {args.model})"
        log(f"peers: skipped, {report['skipped']}")
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        return 0
    draft = "auto" if any(Levels.parse(stack).needs_draft for stack in args.stacks) else None
    engines = {d: load_engine(args.model, d, draft) for d in args.dtypes}
    paired = PAIRED_DRAFTS.get(args.model)
    chat = ChatFormat(next(iter(engines.values())).tokenizer)
    book_ids = chat._user_text(BOOK.read_text(encoding="utf-8-sig").strip())
    q_ids = chat.question_ids(QUESTION, is_first=True, previous_answer_ended=False)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for engine in engines.values():
            warm_up(engine, chat, book_ids)
        for depth in args.contexts:
            doc_ids = book_doc_ids(chat, book_ids, depth)
            run = {"threads": threads, "depth": depth, "n_doc_tokens": len(doc_ids), "ours": {}, "llama.cpp": {}}
            report["runs"].append(run)
            for d, engine in engines.items():
                run[f"load_avg_before_ours_{d}"] = list(psutil.getloadavg())
                run["ours"][d] = ours(engine, chat, doc_ids, q_ids, args.new_tokens, args.stacks, args.exact_drafts)
                log(f"ours {d} t={threads} d={depth}: prefill {run['ours'][d]['prefill_tokens_per_s']:.1f} tok/s, "
                    + ", ".join(f"{k} {v['ms_per_token']:.1f} ms" for k, v in run["ours"][d]["stacks"].items()))
                args.out.write_text(json.dumps(report, indent=1) + "\n")
            if not bench.is_file():  # checked now: a build still running may have finished
                log(f"peers: {bench} is not built yet: ours only")
                continue
            flags = llamacpp_dir() / "BUILD_FLAGS"
            report["llamacpp_build_flags"] = flags.read_text().strip() if flags.is_file() else None
            run["load_avg_before_llamacpp"] = list(psutil.getloadavg())
            run["llama.cpp"]["decode"] = llama_bench(bench, gguf, threads, 0, 32, depth)
            log(f"llama.cpp t={threads} d={depth}: decode {run['llama.cpp']['decode']['ms_per_token']:.1f} ms/token")
            if not args.skip_llamacpp_prefill:
                run["llama.cpp"]["prefill"] = llama_bench(bench, gguf, threads, depth, 0, 0)
                log(f"llama.cpp t={threads} d={depth}: prefill {run['llama.cpp']['prefill']['tokens_per_s']:.0f} tok/s")
            if args.spec:
                prompt = args.out.with_suffix(f".prompt{depth}.txt")
                prompt.write_text(chat.tokenizer.decode(doc_ids + q_ids), encoding="utf-8")
                tools = {"lookup": (bench.parent / "llama-lookup", None)}
                if paired:
                    tools["speculative (draft)"] = (bench.parent / "llama-speculative-simple", gguf_path(paired))
                for name, (tool, draft_gguf) in tools.items():
                    if tool.is_file():
                        run["load_avg_before_llamacpp_" + name] = list(psutil.getloadavg())
                        run["llama.cpp"][name] = llama_spec(tool, gguf, draft_gguf, prompt, threads,
                                                            args.new_tokens, depth + args.new_tokens + 512)
                        log(f"llama.cpp {name} t={threads} d={depth}: {run['llama.cpp'][name]['ms_per_token']:.1f} "
                            f"ms/token, accept {run['llama.cpp'][name]['accept']}")
                        args.out.write_text(json.dumps(report, indent=1) + "\n")
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    report["table"] = table(report) + "\n\n" + stack_table(report)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(report["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
