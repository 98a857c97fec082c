"""The passages quoted beside a question (benchmarks/passages.py): a pure function over text."""

from pathlib import Path

from benchmarks.passages import PassageIndex, sentences, terms, with_passages

BOOK = Path(__file__).resolve().parents[2] / "assets" / "persuasion.txt"
FILLER = " ".join(f"The weather on day {i} was mild and the garden was quiet." for i in range(40))


def test_terms_drop_stop_words_and_match_inflections():
    assert terms("Who rents the Hall?") == terms("rent hall")
    assert terms("Mary married") == ["mary", "marry"]
    assert terms("the Musgroves and Miss Musgrove") == ["musgrove", "miss", "musgrove"]
    assert terms("glass classes") == ["glass", "class"]  # "ss" is not a plural


def test_sentences_split_on_end_marks_and_collapse_space():
    assert sentences('He said "Go!" She went.\n\nThen   night') == ['He said "Go!"', "She went.", "Then night"]


def test_the_sentence_with_the_rare_words_is_found_in_book_order():
    book = (FILLER + " The admiral rents Kellynch Hall from Sir Walter. " + FILLER
            + " Kellynch Hall is in Somerset. " + FILLER)
    found = PassageIndex(book, window=1).find("Who rents Kellynch Hall?", n=2)
    assert found == ["The admiral rents Kellynch Hall from Sir Walter.", "Kellynch Hall is in Somerset."]


def test_runs_do_not_overlap_and_are_clipped():
    book = FILLER + " Anne walked to Uppercross. Anne liked Uppercross. " + FILLER
    found = PassageIndex(book, window=2).find("Where did Anne walk, Uppercross?", n=3, max_chars=30)
    # the best run holds both Anne sentences, cut at a space before 30 characters; the runs beside
    # it share a sentence with it, and the filler scores nothing
    assert found == ["Anne walked to Uppercross. …"]


def test_nothing_to_find_gives_no_passages():
    assert PassageIndex(FILLER).find("What is the the of?") == []  # only stop words
    assert PassageIndex(FILLER).find("Who is Wentworth?") == []  # no sentence holds the word
    assert PassageIndex("").find("Who is Wentworth?") == []
    assert with_passages("Who?", []) == "Who?"


def test_with_passages_quotes_after_or_before_the_question():
    after = with_passages("Who rents it?", ["The admiral does."])
    assert after == 'Who rents it?\n\nPassages of the book that may help:\n"The admiral does."'
    before = with_passages("Who rents it?", ["The admiral does."], first=True)
    assert before.endswith("\n\nWho rents it?") and before.startswith("Passages")


def test_a_real_book_answers_most_questions_in_the_quoted_passages():
    from benchmarks.quality import FACTS, HELD_OUT

    book = BOOK.read_text(encoding="utf-8")[:33_500]  # the quality benchmark's first 8K tokens
    asked = [(q, keys) for q, keys in FACTS + HELD_OUT if all(k.split("|")[0] in book for k in keys)]
    hits, index = 0, PassageIndex(book)
    for question, keys in asked:
        quoted = " ".join(index.find(question)).lower()
        hits += all(any(s.lower() in quoted for s in k.split("|")) for k in keys)
    assert hits >= 0.75 * len(asked), f"{hits} of {len(asked)}"  # measured 24 of 29
