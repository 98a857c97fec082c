"""`python -m api` (api/__main__.py): the server's flags, and the engine's CLI pointing there."""

from __future__ import annotations

from api.__main__ import parse_args


def test_the_api_takes_the_engine_flags_and_its_own():
    args = parse_args(["--model", "smollm2-135m", "--levels", "plain", "--port", "8001", "--api-key", "k",
                       "--no-library", "--max-active", "2", "--max-new-tokens", "64"])
    assert (args.model, args.levels, args.port, args.api_key) == ("smollm2-135m", "plain", 8001, "k")
    assert (args.no_library, args.max_active, args.max_new_tokens, args.host) == (True, 2, 64, "127.0.0.1")
