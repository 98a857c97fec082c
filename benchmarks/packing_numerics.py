"""Does packing several sessions into one forward change the numbers? (issue 6, RESULTS.md)

A 20-token question is forwarded alone, then packed behind a 140-token segment of another session
(the same cache contents both times); prints the largest logit difference, how many argmaxes agree
and the smallest top-2 margin, in bf16 and float32.

    python -m benchmarks.packing_numerics [--model qwen2.5-coder-0.5b]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.cli import add_common_args
from engine.config import EngineConfig
from engine.model import Segment
from engine.session import Engine, Session


def segment(session: Session, ids: list[int], n_logits: int) -> Segment:
    start = session.full.length
    return Segment(torch.tensor([ids]), torch.arange(start, start + len(ids)), session.full, None, n_logits)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.packing_numerics", description=__doc__)
    add_common_args(p, "packing_numerics", threads=False, out=False)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for dtype in ("bfloat16", "float32"):
        engine = Engine.load(EngineConfig(target=args.model, levels="plain", dtype=dtype))
        g = torch.Generator().manual_seed(0)
        doc, other, q = (torch.randint(0, 30000, (n,), generator=g).tolist() for n in (300, 300, 20))
        lone, packed_one, neighbour = engine.open(doc), engine.open(doc), engine.open(other)
        alone = engine.target.forward_packed([segment(lone, q, 20)])[0][0]  # [20, V]
        packed = engine.target.forward_packed([segment(neighbour, q * 7, 1), segment(packed_one, q, 20)])[1][0]
        top2 = alone.float().topk(2, dim=-1).values
        print(f"{dtype}: max |alone - packed| logit {float((alone - packed).abs().max()):.4g}; "
              f"argmax equal at {int((alone.argmax(-1) == packed.argmax(-1)).sum())} of 20; "
              f"smallest top-2 margin {float((top2[:, 0] - top2[:, 1]).min()):.4g}")


if __name__ == "__main__":
    main()
