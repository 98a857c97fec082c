"""`python -m api [--port 8000] [--api-key KEY]`: the OpenAI-compatible API alone, no UI (api/server.py).

Takes the engine's flags (`add_engine_args`, as `app.py` and `python -m tools generate`) and
serves `/v1` under uvicorn, with the app's library of prefill snapshots when the app is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from tools.flags import add_engine_args, add_sampling_args


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m api", description="serve the engine as an OpenAI-compatible API "
                                "(no UI)")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="without --api-key only 127.0.0.1 is answered")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY`")
    p.add_argument("--library", default=None, help="folder of prefill snapshots (default: the app's library)")
    p.add_argument("--no-library", action="store_true", help="keep prefills in memory only")
    p.add_argument("--max-active", type=int, default=4, help="answers decoded together")
    add_sampling_args(p)  # what a request that does not say gets
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import uvicorn
    from starlette.applications import Starlette

    from api.server import ChatAPI, Fixed, interrupt_on_termination
    from engine.batch import Batcher
    from engine.config import EngineError
    from engine.session import Engine
    from tools.chat import ChatFormat
    from tools.flags import apply_threads, engine_config, sampling_from_args
    from tools.models import assemble_missing

    apply_threads(args)
    try:
        config = engine_config(args)
        assemble_missing([config.target, config.draft], lambda message: print(message, file=sys.stderr))
        engine = Engine.load(config)
        engine.default_sampling = sampling_from_args(args, engine.default_sampling)
    except (EngineError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    chat, documents = ChatFormat(engine.tokenizer, end_ids=engine.end_ids), None
    if not args.no_library:
        try:  # the app's library, when it is installed: snapshots shared with the app, by the same rule
            from app.api import library_documents
        except ImportError:
            pass
        else:
            chat, documents = library_documents(engine, args.library)
    api = ChatAPI(Fixed(engine, chat), Batcher(max_active=args.max_active), documents, args.api_key,
                  args.max_new_tokens, keep_sessions=args.max_active)
    print(f"Serving {api.model_id} at http://{args.host}:{args.port}/v1 "
          f"({'API key required' if args.api_key else 'no API key: 127.0.0.1 only'})", flush=True)
    # Ctrl-C, SIGTERM or SIGHUP: uvicorn stops serving, cancels what still streams after 5 s and
    # raises the signal again (KeyboardInterrupt); then the answers under way stop, and a document
    # being read saves what it read (Ctrl-C again: quit now)
    interrupt_on_termination()
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.run(Starlette(routes=api.routes()), host=args.host, port=args.port, log_level="warning",
                    timeout_graceful_shutdown=5)
    api.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
