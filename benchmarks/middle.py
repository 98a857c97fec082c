"""What the middle level buys on this CPU (issue 22, item 2): acceptance and cost of `retrieval>full`
by retrieval budget, with the middle's linears in int8 activations (`quick_drafts`) or exact.

One prefill of the committed book cut to `--context` tokens (kept as a snapshot with `--snapshot`,
so a second run skips it), then one greedy summary of `--new-tokens` tokens per setting:
- `plain`, the baseline;
- `retrieval>full` at each `--budgets` entry, int8 and exact middle, at a FIXED draft length
  (`--gamma`): the adaptive tuner stops drafting after a few rejections, which hides the
  acceptance; here every check drafts, so the table shows what drafting costs and buys.
The table gives ms/token, the top's acceptance, tokens per check, and the seconds of each level:
a check of gamma + 1 tokens against gamma middle steps. A budget holding the whole book isolates
what int8 activations alone cost in acceptance.

    python -m benchmarks.middle --context 16384 --threads 1 --snapshot /tmp/s16k.pt
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.cli import add_common_args
from benchmarks.longctx import BOOK, book_doc_ids, log, machine
from benchmarks.peers import answer
from engine.config import EngineConfig
from engine.session import Engine
from tools.chat import ChatFormat

ROOT = Path(__file__).resolve().parent.parent
QUESTION = "Summarize the story so far in one paragraph."


def table(report: dict) -> str:
    rows = ["| budget | middle | ms/token | vs plain | top acceptance (tested) | tokens/check | middle s | top s |",
            "|---:|---|---:|---:|---:|---:|---:|---:|"]
    plain = report["plain"]["ms_per_token"]
    rows.append(f"| - | plain | {plain:.1f} | 1.00x | | 1.00 | | {report['plain']['levels']['full']['time_s']:.1f} |")
    for r in report["runs"]:
        top, middle = r["levels"]["full"], r["levels"]["retrieval"]
        rows.append(f"| {r['budget']:,} | {r['middle']} | {r['ms_per_token']:.1f} | {plain / r['ms_per_token']:.2f}x "
                    f"| {top['acceptance']:.2f} ({top['n_tested']}) | {top['tokens_per_check']:.2f} "
                    f"| {middle['time_s']:.1f} | {top['time_s']:.1f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.middle", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "middle")
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--budgets", default="1024,4096,16384")
    p.add_argument("--gamma", type=int, default=4, help="fixed draft length; 0: the adaptive tuners, as shipped")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--snapshot", type=Path, help="keep the prefilled book here, and reuse it if present")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = Engine.load(EngineConfig(target=args.model, draft=None, levels="plain", device="cpu",
                                      gamma_middle=args.gamma or None, gamma_bottom=args.gamma or None))
    chat = ChatFormat(engine.tokenizer)
    doc = book_doc_ids(chat, chat._user_text(BOOK.read_text(encoding="utf-8-sig").strip()), args.context)
    q_ids = chat.question_ids(QUESTION, is_first=True, previous_answer_ended=False)
    t0 = time.perf_counter()
    if args.snapshot and args.snapshot.is_file():
        session = engine.restore(args.snapshot)
        assert session.tokens == doc, f"{args.snapshot} holds another document"
    else:
        session = engine.open(doc)
        if args.snapshot:
            session.save(args.snapshot)
    report = {"command": "python -m benchmarks.middle " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": machine(), "n_doc_tokens": len(doc), "ready_s": time.perf_counter() - t0, "runs": []}
    report["plain"] = answer(engine, session, q_ids, len(doc), args.new_tokens, "plain", True)
    log(f"plain {report['plain']['ms_per_token']:.1f} ms/token")
    for budget in (int(b) for b in args.budgets.split(",")):
        r = dataclasses.replace(engine.config.retrieval, budget_tokens=budget)
        engine.config = dataclasses.replace(engine.config, retrieval=r)
        for quick in (True, False):
            run = answer(engine, session, q_ids, len(doc), args.new_tokens, "retrieval>full", quick)
            run.update(budget=budget, middle="int8" if quick else "exact",
                       same_as_plain=run["tokens"] == report["plain"]["tokens"])
            report["runs"].append(run)
            log(f"budget {budget} {run['middle']}: {run['ms_per_token']:.1f} ms/token, "
                f"top acceptance {run['levels']['full']['acceptance']:.2f}")
    report["table"] = table(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(report["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
