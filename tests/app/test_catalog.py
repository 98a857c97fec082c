"""The model picker's search (app/catalog.py) and header reader (app/model_files.py) on fake
Hugging Face cache, LM Studio and Ollama trees holding tiny real GGUFs and config.json folders."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.catalog import Catalog, describe, render_found
from app.model_files import Machine, inspect_model
from tests.app.model_trees import TOKENS, hf_cache_repo, ollama_model, truncate, write_folder, write_gguf

CPU = Machine("cpu", 16 * 10**9, 4, frozenset({"Q4_0", "Q8_0"}))  # 16 GB, float32, these blocks kept


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("BOOKCHAT_CACHE", str(tmp_path / "bookchat-cache"))  # Ollama's links go here
    return tmp_path / "home"


def rows(catalog: Catalog, machine: Machine = CPU) -> dict[str, dict[str, str]]:
    return {found.label: describe(found, machine) for found in catalog.found()}


def test_every_place_a_reader_keeps_models_is_listed_with_family_size_quantization_and_context(home, tmp_path):
    named = tmp_path / "my-models"
    write_gguf(named / "tiny-llama-Q4_0.gguf", qtype="Q4_0", n_context=8192)
    write_folder(named / "tiny-qwen", model_type="qwen2", n_context=32768)
    snapshot = hf_cache_repo(home / ".cache" / "huggingface" / "hub", "org/Tiny-Llama")
    write_folder(snapshot, n_context=131072)
    write_gguf(hf_cache_repo(home / ".cache" / "huggingface" / "hub", "org/Tiny-GGUF") / "tiny-Q8_0.gguf")
    write_gguf(home / ".lmstudio" / "models" / "pub" / "Tiny-GGUF" / "lms-Q8_0.gguf", n_context=16384)
    write_gguf(home / ".cache" / "lm-studio" / "models" / "pub" / "Old" / "old-Q8_0.gguf")
    ollama_model(home / ".ollama" / "models", "tiny", "latest", write_gguf(tmp_path / "x.gguf", n_context=2048))

    table = rows(Catalog([named], home=home, env={}))
    assert table["tiny-llama-Q4_0.gguf"] == {
        "model": "`tiny-llama-Q4_0.gguf`", "where": "models folder", "family": "Llama 2/3.x", "size": "0 MB · 0M",
        "quantization": "Q4_0", "context": "8K", "runs here": "yes"}
    assert table["tiny-qwen"]["family"].startswith("Qwen2") and table["tiny-qwen"]["context"] == "32K"
    assert table["tiny-qwen"]["quantization"] == "BF16"
    assert table["org/Tiny-Llama"]["where"] == "Hugging Face cache" and table["org/Tiny-Llama"]["context"] == "128K"
    assert table["org/Tiny-GGUF/tiny-Q8_0.gguf"]["quantization"] == "Q8_0"
    assert table["pub/Tiny-GGUF/lms-Q8_0.gguf"]["where"] == "LM Studio"
    assert table["pub/Tiny-GGUF/lms-Q8_0.gguf"]["context"] == "16K"
    assert table["pub/Old/old-Q8_0.gguf"]["where"] == "LM Studio"
    assert table["tiny:latest"]["where"] == "Ollama" and table["tiny:latest"]["context"] == "2K"
    assert all(row["runs here"] == "yes" for row in table.values()), table


def test_environment_variables_move_the_hugging_face_cache_and_ollama(home, tmp_path):
    hub, ollama = tmp_path / "elsewhere" / "hub", tmp_path / "ollama-models"
    write_folder(hf_cache_repo(hub, "org/Moved"))
    ollama_model(ollama, "moved", "q8", write_gguf(tmp_path / "y.gguf"))
    found = Catalog(home=home, env={"HF_HUB_CACHE": str(hub), "OLLAMA_MODELS": str(ollama)}).found()
    assert [(f.where, f.label) for f in found] == [("Hugging Face cache", "org/Moved"), ("Ollama", "moved:q8")]
    assert Catalog(home=home, env={"HF_HOME": str(tmp_path / "elsewhere")}).found()[0].label == "org/Moved"


def test_an_ollama_blob_loads_through_a_gguf_name_that_the_engine_accepts_and_that_goes_with_it(home, tmp_path):
    from engine.families import check_model

    blob = ollama_model(home / ".ollama" / "models", "tiny", "latest", write_gguf(tmp_path / "z.gguf"))
    catalog = Catalog(home=home, env={})
    (found,) = catalog.found()
    assert found.source == str(blob) and found.info.family == "llama" and not found.info.problem
    link = Path(catalog.loadable(found.source))
    assert link.suffix == ".gguf" and link.parent == tmp_path / "bookchat-cache" / "links"
    assert link.resolve() == link and link.samefile(blob)  # a hard link: the engine's resolve() keeps the name
    assert check_model(link) == "llama"  # the engine's own check of the file it would load
    assert catalog.loadable(found.source) == str(link)  # made once
    blob.unlink()  # its blob gone: the link goes at the next search, and the bytes with it
    assert rows(Catalog(home=home, env={}))["tiny:latest"]["runs here"] == "no: its file is missing"
    assert not link.exists()


@pytest.mark.parametrize(("make", "why"), [
    (lambda d: truncate(write_gguf(d / "cut.gguf"), 5000),
     "the file is cut short or damaged (an interrupted download?)"),
    (lambda d: (d / "text.gguf").write_text("not a model") and d / "text.gguf", "it is not a GGUF file"),
    (lambda d: write_gguf(d / "bare.gguf", has_tokenizer=False), "it has no tokenizer in its metadata"),
    (lambda d: write_gguf(d / "q81.gguf", qtype="Q8_1"), "its Q8_1 blocks are a type the gguf package cannot read"),
    (lambda d: write_gguf(d / "mamba.gguf", arch="mamba"), "its architecture is not one the engine implements"),
    (lambda d: write_folder(d / "no-tokenizer", tokens=None),
     "it has no tokenizer files (tokenizer.json or tokenizer.model)"),
    (lambda d: truncate(write_folder(d / "cut-folder") / "model.safetensors", 100).parent,
     "model.safetensors is cut short or damaged (an interrupted download?)"),
    (lambda d: write_folder(d / "awq", config={"quantization_config": {"quant_method": "awq"}}),
     "its weights are awq-quantized, which the engine does not read"),
])
def test_a_broken_or_foreign_model_gets_a_row_saying_why_and_the_others_still_list(home, tmp_path, make, why):
    named = tmp_path / "models"
    named.mkdir()
    write_gguf(named / "good.gguf")
    make(named)
    table = rows(Catalog([named], home=home, env={}))
    assert table["good.gguf"]["runs here"] == "yes"
    (broken,) = [row for label, row in table.items() if label != "good.gguf"]
    assert broken["runs here"] == f"no: {why}"
    assert "| no: " + why in render_found(Catalog([named], home=home, env={}).found(), CPU)


def test_dequantized_blocks_are_named_with_what_they_cost_and_too_big_weights_do_not_run(tmp_path):
    from app.catalog import Found

    path = write_gguf(tmp_path / "q51.gguf", qtype="Q5_1", dim=4096)
    info = inspect_model(path)
    n_weights = info.tensor_types["Q5_1"][0] + info.tensor_types["F32"][0]  # float32 once dequantized
    row = describe(Found(str(path), "models folder", path.name, info), CPU)
    assert row["quantization"] == f"Q5_1 (Q5_1 dequantized at load: {n_weights * 4 / 1e6:.0f} MB)", row
    assert row["runs here"] == "yes" and row["size"] == f"{path.stat().st_size / 1e6:.0f} MB · 0M"
    kept = describe(Found(str(path), "models folder", path.name, info), Machine("cpu", 10**9, 4, frozenset({"Q5_1"})))
    assert kept["quantization"] == "Q5_1"  # a kernel type: its blocks as they are, no cost named

    folder = write_folder(tmp_path / "big", n_params=64 * 40_000)  # 2.56M weights, 10 MB in float32
    small = Machine("cpu", 5 * 10**6, 4, frozenset())
    assert describe(Found(str(folder), "", "big", inspect_model(folder)), small)["runs here"] == \
        "no: its weights take 10 MB in memory and this machine has 5 MB"


def test_the_models_folder_is_remembered_and_a_changed_file_is_read_again(home, tmp_path, monkeypatch):
    import app.catalog as catalog_module

    named, library = tmp_path / "models", tmp_path / "library"
    path = write_gguf(named / "m.gguf", n_context=4096)
    assert rows(Catalog([named], root=library, home=home, env={}))["m.gguf"]["context"] == "4K"
    reads = []
    monkeypatch.setattr(catalog_module, "inspect_model", lambda p: reads.append(p) or inspect_model(p))
    again = Catalog(root=library, home=home, env={})  # no --models-dir this time
    assert again.models_dirs == [str(named.resolve())] and rows(again)["m.gguf"]["context"] == "4K"
    assert reads == []  # the header was read once, at the first start
    write_gguf(path, n_context=32768)
    assert rows(Catalog(root=library, home=home, env={}))["m.gguf"]["context"] == "32K" and reads == [path]


def test_a_draft_pairs_only_with_the_same_tokenizer_and_at_most_half_the_weights(home, tmp_path):
    from engine.config import TokenizerMismatch
    from engine.loading import check_same_tokenizer, load_tokenizer

    named = tmp_path / "models"
    target = write_folder(named / "target", n_params=64 * 4096)
    write_folder(named / "small", n_params=64 * 1024)
    write_folder(named / "same-size", n_params=64 * 4096)
    other_vocab = write_folder(named / "other-vocab", n_params=64 * 512, tokens=[*TOKENS[:-1], "<|end|>"])
    write_gguf(named / "small-Q8_0.gguf")  # the same tokens in a GGUF: a draft for a folder
    catalog = Catalog([named], home=home, env={})
    offered = [f.label for f in catalog.drafts_for(catalog.info(target), CPU)]
    assert offered == ["small-Q8_0.gguf", "small"]  # smallest first
    check_same_tokenizer(load_tokenizer(target), load_tokenizer(named / "small"), "target", "small")
    with pytest.raises(TokenizerMismatch):  # the engine's own check agrees with the keys
        check_same_tokenizer(load_tokenizer(target), load_tokenizer(other_vocab), "target", "other")
