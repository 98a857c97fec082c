#!/usr/bin/env bash
# The test command (README): installs what the tests need, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
export GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1
.venv/bin/ruff check engine api app tests benchmarks tools app.py
.venv/bin/python -m pytest -q --timeout 900 -n 2 --dist worksteal "$@"  # one worker per core
