"""OpenAI chat requests -> prompt ids, sampling and stop rules (api/openai_chat.py), on SmolLM2's tokenizer."""

from __future__ import annotations

import pytest

from api.openai_chat import ApiError, StopText, parse_request

MODEL = "smollm2-135m"
BOOK = "It is a truth universally acknowledged. " * 60  # 2,400 characters: a document


@pytest.fixture(scope="module")
def chat():
    from engine import models
    from engine.loading import load_tokenizer
    from tools.chat import ChatFormat

    folder = models.packaged_model_dir(MODEL, convert=False)
    if folder is None:
        pytest.skip(f"{MODEL} is not assembled")
    return ChatFormat(load_tokenizer(folder))


def parse(chat, **body):
    from engine.config import SamplingConfig

    defaults = SamplingConfig(temperature=0.7, top_k=20, max_new_tokens=100)  # as a model's own settings
    return parse_request({"model": MODEL, **body}, chat, MODEL, 8192, defaults, frozenset(chat.stop_ids))


def test_a_chat_about_a_document_has_the_apps_token_order(chat):
    messages = [{"role": "system", "content": BOOK}, {"role": "user", "content": "Who?"},
                {"role": "assistant", "content": "Nobody."}, {"role": "user", "content": [{"type": "text",
                                                                                       "text": "Why?"}]}]
    req = parse(chat, messages=messages)
    doc = chat.document_ids(BOOK)
    assert req.document == BOOK and req.n_document_tokens == len(doc)
    assert req.ids == (doc + chat.question_ids("Who?", True, False) + chat.answer_ids("Nobody.", True)
                       + chat.question_ids("Why?", False, True))
    as_user = parse(chat, messages=[{"role": "user", "content": BOOK}, {"role": "user", "content": "Who?"}])
    assert as_user.ids == req.ids[:len(as_user.ids)]  # the book as the first user message: the same prefill


def test_other_chats_use_the_models_template(chat):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    req = parse(chat, messages=messages)
    text = chat.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert req.document is None and req.n_document_tokens == 0
    assert req.ids == chat.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_request_fields_map_onto_sampling_config(chat):
    req = parse(chat, messages=[{"role": "user", "content": "Hi"}], temperature=0.7, top_p=0.9, top_k=-1, seed=3,
                max_completion_tokens=17, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.1,
                min_p=0.05, stop="\n\n", stream=True, stream_options={"include_usage": True})
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.max_new_tokens) == (0.7, 0.9, 0, 3, 17)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (0.5, -0.5, 1.1, 0.05)
    assert req.stop == ("\n\n",) and req.is_stream and req.include_usage and req.stop_ids == frozenset(chat.stop_ids)
    assert parse(chat, messages=[{"role": "user", "content": "Hi"}], ignore_eos=True).stop_ids == frozenset()
    default = parse(chat, messages=[{"role": "user", "content": "Hi"}]).sampling  # fields left out: the defaults
    assert (default.temperature, default.top_k, default.max_new_tokens) == (0.7, 20, 100)


@pytest.mark.parametrize("body, status, words", [
    ({"temperature": -1}, 400, "temperature"),
    ({"presence_penalty": 3}, 400, "presence_penalty"),
    ({"max_tokens": 0}, 400, "max_new_tokens"),
    ({"top_k": 1.5}, 400, "integer"),
    ({"seed": "7"}, 400, "integer"),
    ({"n": 2}, 400, "n=1"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"model": "gpt-4o"}, 404, "does not exist"),
    ({"messages": []}, 400, "non-empty"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "text"),
    ({"messages": [{"role": "user", "content": "x " * 9000}]}, 400, "context"),
])
def test_bad_fields_raise_openai_errors(chat, body, status, words):
    with pytest.raises(ApiError, match=words) as caught:
        parse(chat, **({"messages": [{"role": "user", "content": "Hi"}]} | body))
    assert caught.value.status == status and caught.value.body()["error"]["message"]


def test_stop_text_never_sends_part_of_a_stop_string():
    answer, stop, sent = "Anne walked to Uppercross. END of the day.", StopText(("END", "\n\n")), ""
    for n in range(1, len(answer) + 1):
        sent += stop.push(answer[:n], n == len(answer))
        assert "E" not in sent[len("Anne walked to Uppercross. "):], sent  # nothing of "END" leaked
        if stop.is_stopped:
            break
    assert sent == "Anne walked to Uppercross. " and stop.is_stopped


def test_stop_text_holds_an_incomplete_character_and_sends_all_at_the_end():
    stop = StopText(())
    assert stop.push("caf\ufffd", False) == "caf"
    assert stop.push("café", True) == "é" and not stop.is_stopped
