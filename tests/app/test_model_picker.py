"""The Model panel through the app's handlers (a fake request per browser session): the drafts it
offers for a target and the stacks that follow, and the one sentence that refuses a model that
cannot load while the open book and its chat stay. Tiny random Llamas speak through SmolLM2's
real tokenizer (skips when it is not assembled); the refused models are tiny real GGUFs."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.catalog import Catalog
from tests.app.model_trees import truncate, write_folder, write_gguf
from tests.conftest import packaged_or_skip
from tests.reliability.conftest import last, make_app, request, run, write_book

pytest.importorskip("gradio")


def tiny_llama(folder: Path, tokenizer, hidden: int, tie: bool) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=tie,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A models folder: a target, a draft of a quarter of its weights with the same tokenizer, a
    small model of another tokenizer, and models that cannot load."""
    from transformers import AutoTokenizer

    smol = AutoTokenizer.from_pretrained(packaged_or_skip("smollm2-135m"))
    root = tmp_path_factory.mktemp("models")
    tiny_llama(root / "target", smol, hidden=128, tie=False)
    tiny_llama(root / "draft", smol, hidden=64, tie=True)
    write_folder(root / "other-tokenizer")  # 29 letters: other ids
    write_gguf(root / "broken" / "mamba.gguf", arch="mamba")
    write_gguf(root / "broken" / "q81.gguf", qtype="Q8_1")
    truncate(write_gguf(root / "broken" / "cut.gguf"), 5000)
    write_folder(root / "broken" / "no-tokenizer", tokens=None)
    return root


@pytest.fixture(scope="module")
def catalog(models, tmp_path_factory) -> Catalog:
    catalog = Catalog([models], home=tmp_path_factory.mktemp("home"), env={})  # each model's header read once
    catalog.found()  # the search done: the first table lists them all
    return catalog


@pytest.fixture(scope="module")
def engine(models):
    from tests.reliability.conftest import load_engine

    return load_engine(models / "target")


@pytest.fixture
def app(engine, catalog, tmp_path):
    return make_app(engine, tmp_path / "library", catalog=catalog)


def offered_stacks(app, updates: list[dict]) -> list:
    """The level stacks the Settings offered last (app/settings.py names the control `levels`)."""
    control = app.c.settings["levels"]
    return [u[control] for u in updates if control in u][-1]["choices"]


def test_the_picker_offers_the_draft_that_pairs_and_the_level_stacks_follow(app, models):
    target, draft = str(models / "target"), str(models / "draft")
    assert app.draft_choices(target) == [("draft · models folder", draft), ("none", "none")]
    assert app.drafts_offered(target)["value"] == draft
    assert app.draft_choices(draft) == [("none", "none")]  # nothing here is small enough to draft for it
    assert "| `draft` | models folder |" in app.model_table() and "| `broken/cut.gguf` |" in app.model_table()
    table, model_update, draft_update = app.refresh_picker()  # what a page opened now shows
    assert ("target · models folder", target) in model_update["choices"] and model_update["value"] == target
    assert draft_update["choices"][0] == ("draft · models folder", draft) and draft_update["value"] == "none"

    req = request("reader")
    updates = run(app.switch_model(target, False, req, "auto"))
    assert last(app, updates, "model_status").startswith(f"`{target}` is loaded"), updates
    assert app.backend.draft == draft and app.backend.engine.has_draft
    assert "draft>full" in offered_stacks(app, updates)
    assert f"draft `{draft}`" in last(app, updates, "models")

    updates = run(app.switch_model(target, False, req, "none"))
    assert app.backend.draft is None and not app.backend.engine.has_draft
    stacks = offered_stacks(app, updates)
    assert "ngram>full" in stacks and not any("draft" in s for s in stacks), stacks


RUNS = "Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 (dense), Gemma 2, Gemma 3 (text), Phi-3/3.5"  # engine/families.py


@pytest.mark.parametrize(("bad", "draft", "why"), [
    ("broken/mamba.gguf", "none",
     f"its architecture is not one the engine implements (mamba; the engine runs {RUNS})."),
    ("broken/q81.gguf", "none", "its Q8_1 blocks are a type the gguf package cannot read."),
    ("broken/cut.gguf", "none", "the file is cut short or damaged (an interrupted download?)."),
    ("broken/no-tokenizer", "none", "it has no tokenizer files (tokenizer.json or tokenizer.model)."),
    ("target", "other-tokenizer", "the draft `other-tokenizer` gives other token ids (its vocabulary or special "
     "tokens differ), so pick a draft of the same family or none."),
    ("target", "broken/cut.gguf", "its draft `broken/cut.gguf`: the file is cut short or damaged (an interrupted "
     "download?)."),
])
def test_a_model_that_cannot_load_is_refused_in_one_sentence_and_the_book_and_chat_stay(app, models, tmp_path,
                                                                                         bad, draft, why):
    req, loaded = request("reader"), app.backend
    assert "Ready" in last(app, run(app.load_book(str(write_book(tmp_path)), "", req)), "status")
    assert "done" in last(app, run(app.ask("Who is Sir Walter?", [], 0.0, 1.0, 4, 0, "ngram>full", req)), "metrics")
    book, turns = app.users["reader"].book, list(app.users["reader"].book.turns)

    draft = draft if draft == "none" else str(models / draft)
    status = last(app, run(app.switch_model(str(models / bad), False, req, draft)), "model_status")
    assert status == f"⚠ Could not load `{models / bad}`: {why} `{loaded.name}` stays loaded."
    assert app.backend is loaded and app.users["reader"].book is book and book.turns == turns
    assert "done" in last(app, run(app.ask("Who is Anne?", [], 0.0, 1.0, 4, 0, "ngram>full", req)), "metrics")
