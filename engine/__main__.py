"""`python -m engine` moved: the engine's command line is one of its callers (tools/)."""

import sys

sys.exit("`python -m engine` moved: run `python -m tools generate` or `python -m tools selftest` (same flags); "
         "the OpenAI-compatible API is `python -m api`.")
