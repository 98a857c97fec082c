"""The engine's command-line flags, shared by `app.py`, `python -m tools generate` and `python -m api`:
each maps onto one EngineConfig or SamplingConfig field and takes its default from there
(engine/config.py), so a default lives in one place.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from engine.config import ANSWER_TOKENS, LEVEL_STACKS, SAMPLING_FIELDS, EngineConfig, SamplingConfig


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """A flag for each of SAMPLING_FIELDS (`--top-p`, `--max-new-tokens`, ...): unset, the model's
    own (its generation_config, `Engine.default_sampling`), and for the answer length ANSWER_TOKENS."""
    for name, kind in SAMPLING_FIELDS.items():
        default = ANSWER_TOKENS if name == "max_new_tokens" else None
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default,
                            help=f"default {default}" if default else "default: the model's own")


def sampling_from_args(args: argparse.Namespace, defaults: SamplingConfig) -> SamplingConfig:
    """`defaults` with what the flags of `add_sampling_args` set."""
    given = {name: getattr(args, name) for name in SAMPLING_FIELDS if getattr(args, name) is not None}
    return replace(defaults, **given)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, shared by `app.py`, `python -m tools generate` and `python -m api`; each maps
    onto one EngineConfig field (`engine_config`) and takes its default from there."""
    p, c = parser, EngineConfig
    p.add_argument("--model", default=c.target, help="packaged name, folder, .gguf or hub id")
    p.add_argument("--draft", default=c.draft, help="draft model for the `draft` level (same tokenizer); "
                   "auto: the 0.5B for the 1.5B, none for other models")
    p.add_argument("--levels", default=c.levels, choices=("auto", *LEVEL_STACKS),
                   help="auto: on a GPU draft>retrieval>full with a draft, on a CPU retrieval>full; "
                   "ngram>retrieval>full without a draft")
    p.add_argument("--yarn", type=float, default=c.yarn_factor, metavar="FACTOR",
                   help="YaRN context extension for books beyond the native context (4: 131,072 tokens for "
                   "Qwen2.5; changes answers on short books too; a book that long takes hours to read on a CPU: "
                   "the app shows this machine's estimate)")
    p.add_argument("--device", default=c.device, help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", default=c.dtype, help="auto, float32, bfloat16, float16")
    p.add_argument("--gpus", type=int, default=c.n_gpus, help="tensor parallel over N GPUs")
    p.add_argument("--offload", action="store_true", help="full KV cache in host memory, streamed per layer")
    p.add_argument("--resident-kv-layers", type=int, default=c.resident_kv_layers,
                   help="with --offload: layers kept on the GPU")
    p.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=c.use_flash_attn)
    p.add_argument("--cpu-kernel", action=argparse.BooleanOptionalAction, default=c.use_cpu_kernel,
                   help="compiled AVX2 attention on CPU (SDPA when off or it cannot build)")
    p.add_argument("--cuda-graphs", action="store_true", help="CUDA graphs where shapes allow (eager on CPU)")
    p.add_argument("--quick-drafts", action=argparse.BooleanOptionalAction, default=c.quick_drafts,
                   help="levels below the top read the GGUF's blocks with int8 activations (the top stays exact)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")


def apply_threads(args: argparse.Namespace) -> None:
    """`--threads N`: torch's CPU threads for this process (0: torch's default). On 2 shared cores,
    1 thread can be many times faster than OpenMP threads spinning beside another job."""
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of the flags `add_engine_args` defined (`--threads`: `apply_threads`)."""
    return EngineConfig(target=args.model, draft=args.draft, levels=args.levels, yarn_factor=args.yarn,
                        device=args.device, dtype=args.dtype, n_gpus=args.gpus, offload_kv=args.offload,
                        resident_kv_layers=args.resident_kv_layers, use_flash_attn=args.flash_attn,
                        use_cpu_kernel=args.cpu_kernel, use_cuda_graphs=args.cuda_graphs,
                        quick_drafts=args.quick_drafts)
