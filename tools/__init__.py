"""Callers of the engine that are not the app: the command line (`python -m tools generate`,
`python -m tools selftest`) and the packaged models' assembly (`python -m tools.models`)."""
