"""Code around the engine that is not the engine: chat prompts from a model's template (`chat.py`,
used by app/, api/ and the command line), the command line (`python -m tools generate`,
`python -m tools selftest`) and the packaged models' assembly (`python -m tools.models`)."""
