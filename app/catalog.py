"""The models already on this machine, for the model picker: where they are and which pair.

Searched, never downloaded: the folders the reader names (`--models-dir`, remembered in
`<library>/settings.json`), the Hugging Face cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, each
repo's snapshot that refs/main names), LM Studio's models folders (~/.lmstudio/models,
~/.cache/lm-studio/models) and Ollama's (`$OLLAMA_MODELS`, else ~/.ollama/models: each manifest's
layer of media type `application/vnd.ollama.image.model` names the GGUF blob; a blob is loaded
through a link with a .gguf name in the engine's cache, `gguf_link`). Each model is read
by app/model_files.py from its metadata alone, once per file version (`<library>/model-infos.json`).
A draft pairs with a target when their tokenizers' keys are equal (same vocabulary and special
tokens) and it has at most half the target's weights; the engine checks the tokenizers again at load.
This module knows nothing of Gradio.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from app.model_files import Machine, ModelInfo, blockers, dequantized_types, inspect_model, weight_bytes
from app.speeds import disk_size
from app.storage import read_json, write_json

OLLAMA_MODEL = "application/vnd.ollama.image.model"
MAX_DEPTH = 5  # folders below a models folder searched: LM Studio's publisher/repo/file is 2
DRAFT_SHARE = 0.5  # a draft has at most this share of the target's weights


@dataclass(frozen=True)
class Found:
    source: str  # what the engine loads: a .gguf path or a folder
    where: str  # "models folder", "Hugging Face cache", "LM Studio", "Ollama"
    label: str  # what the reader knows it as: Ollama's name:tag, the hub id, the file name
    info: ModelInfo


def search_roots(models_dirs: list[Path], env: dict | None = None, home: Path | None = None) -> list[tuple[str, Path]]:
    """(where, folder) of every place searched, those the reader named first."""
    env, home = os.environ if env is None else env, home or Path.home()
    hf_home = Path(env.get("HF_HOME") or home / ".cache" / "huggingface")
    roots = [("models folder", Path(d).expanduser()) for d in models_dirs]
    roots.append(("Hugging Face cache", Path(env.get("HF_HUB_CACHE") or hf_home / "hub")))
    roots += [("LM Studio", home / ".lmstudio" / "models"), ("LM Studio", home / ".cache" / "lm-studio" / "models")]
    roots.append(("Ollama", Path(env.get("OLLAMA_MODELS") or home / ".ollama" / "models")))
    return [(where, root) for where, root in roots if root.is_dir()]


def model_paths(root: Path, depth: int = MAX_DEPTH) -> list[Path]:
    """The .gguf files and the folders with a config.json under `root` (not below such a folder)."""
    if (root / "config.json").is_file():
        return [root]
    found = []
    try:
        entries = sorted(root.iterdir())
    except OSError:  # unreadable: nothing to list there
        return []
    for entry in entries:
        if entry.is_file() and entry.suffix == ".gguf":
            found.append(entry)
        elif entry.is_dir() and depth > 0 and not entry.name.startswith("."):
            found += model_paths(entry, depth - 1)
    return found


def hf_snapshots(hub: Path) -> list[tuple[str, Path]]:
    """(repo id, snapshot folder) of each model repo in a Hugging Face cache: the revision
    refs/main names, else the newest snapshot."""
    found = []
    for repo in sorted(hub.glob("models--*")):
        snapshots = repo / "snapshots"
        ref = repo / "refs" / "main"
        revision = ref.read_text().strip() if ref.is_file() else ""
        if not (snapshots / revision).is_dir() or not revision:
            folders = sorted(snapshots.glob("*"), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
            if not folders:
                continue
            revision = folders[-1].name
        found.append((repo.name.removeprefix("models--").replace("--", "/"), snapshots / revision))
    return found


def ollama_models(models: Path) -> list[tuple[str, Path]]:
    """(name:tag, GGUF blob) of each Ollama manifest (manifests/<host>/<namespace>/<name>/<tag>)."""
    found = []
    for manifest in sorted((models / "manifests").rglob("*")):
        if not manifest.is_file():
            continue
        try:
            layers = json.loads(manifest.read_text(encoding="utf-8")).get("layers", [])
        except (OSError, ValueError, AttributeError):
            continue  # not a manifest
        for layer in layers:
            if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL:
                blob = models / "blobs" / str(layer.get("digest", "")).replace(":", "-")
                name = manifest.parent.name if manifest.parent.parent.name == "library" else \
                    f"{manifest.parent.parent.name}/{manifest.parent.name}"
                found.append((f"{name}:{manifest.name}", blob))
    return found


class Catalog:
    """The models found on this machine, read once per file version; the reader's models folders
    are remembered in `root` (the library folder; None: nothing is written)."""

    def __init__(self, models_dirs: list[str | Path] = (), root: Path | None = None, env: dict | None = None,
                 home: Path | None = None):
        self.root, self.env, self.home = root, env, home
        settings = read_json(root / "settings.json") if root else None
        remembered = (settings or {}).get("models_dirs", [])
        named = [str(Path(d).expanduser().resolve()) for d in models_dirs]
        self.models_dirs = list(dict.fromkeys([*remembered, *named]))
        if root and self.models_dirs != remembered:
            write_json(root / "settings.json", {**(settings or {}), "models_dirs": self.models_dirs})
        self._infos: dict = (read_json(root / "model-infos.json") or {}) if root else {}
        self._found: list[Found] = []  # grows as the search reads each model's header
        self._lock = threading.Lock()  # one search and one header read at a time
        self._search_thread: threading.Thread | None = None

    def info(self, path: str | Path) -> ModelInfo:
        """The file's or folder's ModelInfo, read again only when its size or time changed."""
        path = Path(path)
        stamp = _stamp(path)
        cached = self._infos.get(str(path))
        if cached and cached.get("stamp") == stamp:
            return ModelInfo(**cached["info"])
        info = inspect_model(path)
        with self._lock:
            self._infos[str(path)] = {"stamp": stamp, "info": asdict(info)}
            if self.root:
                with contextlib.suppress(OSError):  # a full disk: the next start reads the files again
                    write_json(self.root / "model-infos.json", self._infos)
        return info

    def search(self) -> None:
        """Start reading the headers of every model here, in the background (once)."""
        with self._lock:
            if self._search_thread is None:
                self._search_thread = threading.Thread(target=self._search, daemon=True, name="model-search")
                self._search_thread.start()

    @property
    def is_searching(self) -> bool:
        return self._search_thread is None or self._search_thread.is_alive()

    def found(self, wait: bool = True) -> list[Found]:
        """The models found here; without `wait`, those read so far (a first start reads every header)."""
        self.search()
        if wait:
            self._search_thread.join()
        return list(self._found)

    def _search(self) -> None:
        remove_stale_links()
        seen = set()
        for where, root in search_roots([Path(d) for d in self.models_dirs], self.env, self.home):
            if where == "Ollama":
                located = ollama_models(root)
            elif where == "Hugging Face cache":
                located = [(repo if path == snap else f"{repo}/{path.name}", path)
                           for repo, snap in hf_snapshots(root) for path in model_paths(snap, 1)]
            else:
                located = [(str(path.relative_to(root)) if path != root else path.name, path)
                           for path in model_paths(root)]
            for label, path in located:
                if path.resolve() not in seen:  # a file under a named folder and in LM Studio's is one model
                    seen.add(path.resolve())
                    self._found.append(Found(str(path), where, label, self.info(path)))

    def loadable(self, source: str) -> str:
        """What the engine loads for `source`: a .gguf name for a blob (`gguf_link`), else `source`."""
        path = Path(source).expanduser()
        return str(gguf_link(path)) if path.is_file() else source

    def by_source(self, source: str) -> Found | None:
        return next((f for f in self.found(wait=False) if f.source == source), None)

    def drafts_for(self, target: ModelInfo, machine: Machine, pool: list[Found] | None = None) -> list[Found]:
        """The models of `pool` (default: those found here) that can draft for `target`, smallest first."""
        if not target.vocab_key:
            return []
        fits = [f for f in (self.found() if pool is None else pool)
                if f.info.vocab_key == target.vocab_key and f.info.path != target.path
                and 0 < f.info.n_params <= DRAFT_SHARE * target.n_params and not blockers(f.info, machine)]
        return sorted(fits, key=lambda f: f.info.n_params)


def gguf_link(path: Path) -> Path:
    """`path` itself, or, where the file it names has no .gguf name (an Ollama blob, a Hugging Face
    cache blob), `<cache>/links/<sha256 of its path>.gguf`: a hard link, so the name survives the
    engine resolving the path (a symbolic one across file systems, which the engine may refuse)."""
    from engine.files import cache_root

    real = path.resolve()
    if real.is_dir() or real.suffix == ".gguf":
        return path
    link = cache_root() / "links" / f"{hashlib.sha256(str(real).encode()).hexdigest()[:16]}.gguf"
    if link.exists() and os.path.samefile(link, real):
        return link
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    try:
        os.link(real, link)
    except OSError:  # another file system
        link.symlink_to(real)
    return link


def remove_stale_links() -> None:
    """Drop the links to models deleted since (a hard link then holds the file's last name)."""
    from engine.files import cache_root

    for link in (cache_root() / "links").glob("*.gguf"):
        with contextlib.suppress(OSError):
            if (link.is_symlink() and not link.exists()) or (not link.is_symlink() and link.stat().st_nlink == 1):
                link.unlink()


def _stamp(path: Path) -> list[int]:
    """Size and modification time of a file, or of a folder's files (weights, config, tokenizer)."""
    try:
        files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
        stats = [p.stat() for p in files]
    except OSError:
        return []
    return [sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0)]


def describe(found: Found, machine: Machine) -> dict[str, str]:
    """The picker's row: model, where, family, size, quantization, context, runs here."""
    info = found.info
    why = blockers(info, machine)
    quant = info.quantization or "?"
    dequantized = dequantized_types(info, machine)
    if dequantized and not why:
        quant += f" ({', '.join(dequantized)} dequantized at load: {disk_size(weight_bytes(info, machine))})"
    params = "" if not info.n_params else f" · {info.n_params / 1e9:.1f}B" if info.n_params >= 1e9 else \
        f" · {info.n_params / 1e6:.0f}M"
    return {"model": f"`{found.label}`", "where": found.where, "family": info.family_name if info.family else "?",
            "size": f"{disk_size(info.n_bytes)}{params}" if info.n_bytes else "?", "quantization": quant,
            "context": f"{info.n_context // 1024}K" if info.n_context >= 1024 else (str(info.n_context or "?")),
            "runs here": "yes" if not why else f"no: {why}"}


def render_found(found: list[Found], machine: Machine) -> str:
    """The found models as a Markdown table ("" when there are none)."""
    if not found:
        return ""
    rows = [describe(f, machine) for f in found]
    head = "| " + " | ".join(rows[0]) + " |\n|" + ":--|" * len(rows[0])
    return head + "\n" + "\n".join("| " + " | ".join(r.values()) + " |" for r in rows)
