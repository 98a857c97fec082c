"""The engine's face in one import, `from engine import Engine, EngineConfig, SamplingConfig` (its use:
docs/DESIGN.md "The engine's face"; engine/README.md walks one request through the modules).
Names resolve on first use, so `import engine.config` (flags, settings) stays free of torch.
"""

from __future__ import annotations

import importlib

_FACE = {
    "engine.session": ("Engine", "Session", "Event", "Stats"),
    "engine.config": ("EngineConfig", "SamplingConfig", "RetrievalConfig", "Levels", "EngineError",
                      "DocumentTooLong", "EmptyPrompt", "TokenizerMismatch", "ModelNotFound", "OutOfMemoryPlan",
                      "Cancelled", "BadTokens", "Busy"),
}
_MODULE_OF = {name: module for module, names in _FACE.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)
