"""The quality benchmark's scoring, exactly, and a smoke run of benchmarks/quality.py --quick on
SmolLM2: one prefill answers the facts, the three pass keys and the summary, and the report holds
them. No quality or speed assertions: those are measured, not tested."""

import json

import pytest

from benchmarks import quality
from tests.conftest import packaged_or_skip


def test_a_phrase_four_times_is_a_loop_and_key_words_must_all_appear():
    assert quality.loops("Pip, Pip, Pip, Pip, Pip, Pip, Pip.")  # "pip pip pip pip" occurs 4 times
    assert quality.loops("He is the man. He is the man. He is the man. He is the man.")
    assert not quality.loops("He is the man. He is the man. He is the man.")  # three times is allowed
    assert quality.is_right("Louisa and Henrietta Musgrove.", ("Louisa", "Henrietta"))
    assert not quality.is_right("Louisa Musgrove.", ("Louisa", "Henrietta"))
    assert not quality.is_right("Kellynch " + "the hall the hall " * 4, ("Kellynch",))  # right word, but loops
    assert quality.is_right("He is 54 years old.", ("fifty-four|54",))  # any listed spelling counts
    assert quality.is_right("Mrs Penelope Clay.", ("Clay|Penelope",))
    assert quality.is_right("Her name is Penelope.", ("Clay|Penelope",))
    assert not quality.is_right("He is fifty.", ("fifty-four|54",))


def test_held_out_key_words_are_in_the_first_8k_tokens_and_the_first_set_is_in_the_book():
    book = quality.BOOK.read_text(encoding="utf-8")
    first_8k = book[:33_500]  # 8,192 Qwen tokens hold ~34,100 characters of Persuasion
    for _, keys in quality.HELD_OUT:
        assert all(k.split("|")[0] in first_8k for k in keys), keys  # the book's own spelling
    for _, keys in quality.FACTS:
        assert all(k.split("|")[0] in book for k in keys), keys
    assert not {q for q, _ in quality.FACTS} & {q for q, _ in quality.HELD_OUT}


def test_needles_sit_at_their_depths_and_only_answerable_facts_count():
    text = "\n\n".join(f"Paragraph {i} about Kellynch." for i in range(100))
    keys = {"red": "11111", "green": "22222", "blue": "33333"}
    hidden = quality.with_needles(text, keys)
    for door, depth in quality.NEEDLES:
        at = hidden.index(f"The pass key of the {door} door is {keys[door]}.")
        assert abs(at / len(hidden) - depth) < 0.03
    asked = quality.questions(hidden, keys)
    facts = [q for kind, q, _ in asked if kind in ("fact", "held-out")]
    assert facts == [quality.FACTS[0][0] + quality.ONE_SENTENCE]  # only Kellynch is in this text
    assert [k for kind, _, k in asked if kind == "passkey"] == [("11111",), ("22222",), ("33333",)]


@pytest.mark.slow
def test_quick_run_reports_every_question(tmp_path):
    packaged_or_skip("smollm2-135m")
    out = tmp_path / "quality.json"
    assert quality.main(["--quick", "--threads", "1", "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert 900 <= run["context"] <= 1100 and run["setting"] == "greedy"
    kinds = [r["kind"] for r in run["rows"]]
    assert kinds.count("passkey") == 3 and kinds[-1] == "summary" and "fact" in kinds
    assert all(isinstance(r["right"], bool) for r in run["rows"] if r["kind"] != "summary")
    assert "| smollm2-135m |" in out.with_suffix(".md").read_text()
