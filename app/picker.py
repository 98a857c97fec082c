"""What the Model panel offers: the targets found here, the drafts that pair with one, and the
sentence that refuses a model before the engine is asked to load it.

The packaged models (engine/models.py) come first, then what app/catalog.py found on this
machine. A draft is offered for a target when their tokenizers give the same ids: a packaged
target's own pair (engine/config.py `PAIRED_DRAFTS`), else the smallest model found here (or
packaged and assembled) with the target's tokenizer key and at most half its weights. The
engine checks the tokenizers again when it loads the pair. This module knows nothing of Gradio.
"""

from __future__ import annotations

from pathlib import Path

from app.catalog import Catalog, Found
from app.model_files import Machine, ModelInfo, NotRunnable, blockers
from engine import models
from engine.config import PAIRED_DRAFTS

NO_DRAFT = "none"


def machine_of(device, dtype) -> Machine:
    """The memory and GGUF kernel types of `device` in `dtype` (torch's): where a model would load."""
    import psutil
    import torch

    from engine.memory import free_memory_bytes
    from engine.quant import KERNEL_TYPES

    on_cpu = device.type == "cpu"
    memory = psutil.virtual_memory().total if on_cpu else free_memory_bytes(device)
    # a CPU in float32 or bfloat16 keeps these types' blocks where the kernel builds (AVX2: every x86 here)
    kept = frozenset(KERNEL_TYPES.values()) if on_cpu and dtype in (torch.float32, torch.bfloat16) else frozenset()
    return Machine(device.type, memory, torch.finfo(dtype).bits // 8, kept)


def packaged_found(catalog: Catalog) -> list[Found]:
    """The packaged models whose GGUF is assembled, as drafts the catalog can pair."""
    return [Found(name, "packaged", name, catalog.info(models.gguf_path(name)))
            for name in models.PACKAGED_MODELS if models.gguf_path(name).is_file()]


def model_choices(catalog: Catalog | None) -> list[tuple[str, str]]:
    """(label, source) of every model the picker offers: packaged names, then those found here so far."""
    packaged = [(name, name) for name in models.PACKAGED_MODELS]
    found = catalog.found(wait=False) if catalog else []
    return packaged + [(f"{f.label} · {f.where}", f.source) for f in found]


def info_of(catalog: Catalog | None, source: str) -> ModelInfo | None:
    """The ModelInfo of a path the reader picked or typed (None: a packaged name or a hub id)."""
    path = Path(source).expanduser()
    if catalog is None or source in models.PACKAGED_MODELS or not (path.is_file() or path.is_dir()):
        return None
    found = catalog.by_source(source)
    return found.info if found else catalog.info(path)


def drafts(catalog: Catalog | None, machine: Machine, target: str, wait: bool = True) -> list[tuple[str, str]]:
    """(label, source) of the drafts that pair with `target`, the suggested one first. Without
    `wait`: among the models read so far, and a packaged target's own pair."""
    paired = PAIRED_DRAFTS.get(target)
    offered = [(paired, paired)] if paired else []
    if catalog is None:
        return offered
    info = info_of(catalog, target) if wait or catalog.by_source(target) else None
    is_assembled = target in models.PACKAGED_MODELS and models.gguf_path(target).is_file()
    if info is None and wait and is_assembled:
        info = catalog.info(models.gguf_path(target))
    if info is not None:
        pool = [*catalog.found(wait), *(packaged_found(catalog) if wait else [])]
        offered += [(f"{f.label} · {f.where}", f.source) for f in catalog.drafts_for(info, machine, pool)
                    if f.source != paired]
    return offered


def suggested_draft(catalog: Catalog | None, machine: Machine, target: str) -> str | None:
    offered = drafts(catalog, machine, target)
    return offered[0][1] if offered else None


def check_loadable(catalog: Catalog | None, machine: Machine, target: str, draft: str | None) -> None:
    """Raise NotRunnable, one sentence, for a target or draft whose files say it will not load
    here, or a draft whose tokenizer gives other ids than the target's."""
    infos = {}
    for what, source in (("target", target), ("draft", draft)):
        info = info_of(catalog, source) if source else None
        if info is not None and (why := blockers(info, machine)):
            who = "" if what == "target" else f"its draft {_name(catalog, source)}: "
            raise NotRunnable(f"{who}{why}{_families(info)}.")
        infos[what] = info
    target_info, draft_info = infos["target"], infos["draft"]
    if target_info and draft_info and target_info.vocab_key != draft_info.vocab_key:
        raise NotRunnable(f"the draft {_name(catalog, draft)} gives other token ids (its vocabulary or special "
                          "tokens differ), so pick a draft of the same family or none.")


def _families(info: ModelInfo) -> str:
    """' (the engine runs Llama 2/3.x, ...)' when the engine refused the family itself."""
    from engine.families import FAMILY_NAMES

    if not info.family or info.family in FAMILY_NAMES or "architecture" not in info.problem:
        return ""
    return f" ({info.family}; the engine runs {', '.join(FAMILY_NAMES.values())})"


def _name(catalog: Catalog | None, source: str) -> str:
    found = catalog.by_source(source) if catalog else None
    return f"`{found.label}`" if found else f"`{Path(source).name}`"
