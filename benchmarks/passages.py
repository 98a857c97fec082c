"""The book's passages that share the rarest words with a question (BM25), quoted beside it.

A small model reading a long book often names the wrong person, although the sentence that
answers is in its context (issue 21). Quoting that sentence next to the question puts it where
the model reads best. This is prompt text: the answer is still exactly the model's for the prompt
it is given. Nothing here runs a model. Measured in benchmarks/quality.py (`--prompts passages`):
no better at 8K or 32K (RESULTS.md), so the app does not quote passages; this stays a benchmark variant.
"""

from __future__ import annotations

import math
import re
from collections import Counter

_WORD = re.compile(r"[a-z0-9]+")
_SENTENCE = re.compile(r"[^.!?]+(?:[.!?]+[\"'”’)\]]*|$)")
_STOP_WORDS = """a an the of to in on at by for from with and or but is are was were be been being do does did what
which who whom whose when where why how that this these those it its his her their he she they him
them i you we me my your our as not no than then there here into about after before so such only own
same too very can will would should could may might must has have had any each one answer short
sentence book says"""
_STOP = frozenset(_STOP_WORDS.split())
BM25_K1, BM25_B = 1.2, 0.75


def terms(text: str) -> list[str]:
    """Lower-case words without stop words, crudely stemmed ("rents" -> "rent", "married" -> "marry")."""
    return [_stem(w) for w in _WORD.findall(text.lower()) if w not in _STOP]


_SUFFIXES = (("ies", "y"), ("ied", "y"), ("ing", ""), ("ed", ""), ("ches", "ch"), ("shes", "sh"), ("xes", "x"),
             ("sses", "ss"), ("s", ""))


def _stem(word: str) -> str:
    if word.endswith("ss"):  # "glass", "miss": not plurals
        return word
    for suffix, keep in _SUFFIXES:
        if word.endswith(suffix) and len(word) - len(suffix) >= 3:
            return word[: -len(suffix)] + keep
    return word


def sentences(book: str) -> list[str]:
    """The book's sentences, white space collapsed."""
    return [s for s in (" ".join(m.group().split()) for m in _SENTENCE.finditer(book)) if s]


class PassageIndex:
    """Every run of `window` sentences of a book and its terms, built once per book, so
    a question is scored quickly."""

    def __init__(self, book: str, window: int = 4):
        self.said, self.window = sentences(book), window
        per_sentence = [Counter(terms(s)) for s in self.said]
        self.runs = [sum(per_sentence[i:i + window], Counter()) for i in range(max(0, len(self.said) - window + 1))]
        lengths = [sum(r.values()) for r in self.runs]
        mean_length = sum(lengths) / max(1, len(lengths))
        self.norms = [BM25_K1 * (1 - BM25_B + BM25_B * n / mean_length) for n in lengths]  # BM25's length term

    def find(self, question: str, n: int = 3, max_chars: int = 800) -> list[str]:
        """Up to `n` non-overlapping runs that score best for `question` (BM25), in book order, each
        cut to about `max_chars` characters."""
        asked = set(terms(question))
        df = Counter(t for r in self.runs for t in asked & r.keys())
        idf = {t: math.log(1 + (len(self.runs) - df[t] + 0.5) / (df[t] + 0.5)) for t in df}
        scores = [sum(idf[t] * run[t] * (BM25_K1 + 1) / (run[t] + norm) for t in idf)
                  for run, norm in zip(self.runs, self.norms)]
        picked: list[int] = []
        for i in sorted(range(len(self.runs)), key=lambda i: -scores[i]):
            if len(picked) == n or scores[i] <= 0:
                break
            if all(abs(i - j) >= self.window for j in picked):
                picked.append(i)
        return [_clip(" ".join(self.said[i:i + self.window]), max_chars) for i in sorted(picked)]


def _clip(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: text.rfind(" ", 0, chars)] + " …"


def with_passages(question: str, passages: list[str], first: bool = False) -> str:
    """The user turn's text: the question with the passages quoted after it (or before it)."""
    if not passages:
        return question
    quoted = "Passages of the book that may help:\n" + "\n".join(f'"{p}"' for p in passages)
    return f"{quoted}\n\n{question}" if first else f"{question}\n\n{quoted}"
