"""ChatFormat: prompt pieces equal the tokenized rendered template, and user text stays text.

Runs on two tiny in-memory tokenizers (no files, no network) and on the packaged real ones
(SmolLM2, Qwen2.5-Coder 0.5B / 1.5B), which skip when not assembled.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.loading import load_tokenizer
from tests.conftest import packaged_or_skip
from tools.chat import BOOK_SYSTEM, SEPARATOR, ChatFormat

BOOK_PATH = Path(__file__).resolve().parents[2] / "assets" / "persuasion.txt"  # committed
BOOK = (
    "Chapter 1\n\nSir Walter Elliot, of Kellynch Hall, in Somersetshire, was a man who, for his own "
    "amusement, never took up any book but the Baronetage; there he found occupation for an idle "
    "hour, and consolation in a distressed one.\n\n\"Anne,\" said he, \"is nobody.\"  1814.\n"
)
# Every string a chat template of ours treats as control, plus some it does not.
CONTROL_STRINGS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "</s>", "<s>", "<|eot_id|>",
                   "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (  # trims the content and puts "\n\n" between a header and the user text
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Llama-3 / Qwen2 pre-tokenizer regex, and GPT-2's (SmolLM2's ByteLevel default).
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PACKAGED = ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]


def tiny_tokenizer(template: str, gpt2_regex: bool) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few sentences, with ChatML and Llama-3 control tokens."""
    tokenizer = Tokenizer(models.BPE())
    if gpt2_regex:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
                "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([BOOK * 3, CHATML, "Question: who is Anne?\n\n"], trainer)
    is_llama3 = template == LLAMA3
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, chat_template=template,
        bos_token="<|begin_of_text|>" if is_llama3 else "<|im_start|>",
        eos_token="<|eot_id|>" if is_llama3 else "<|im_end|>",
    )


TINY = {
    "chatml-gpt2": lambda: tiny_tokenizer(CHATML, gpt2_regex=True),
    "chatml-llama3": lambda: tiny_tokenizer(CHATML, gpt2_regex=False),
    "llama3-llama3": lambda: tiny_tokenizer(LLAMA3, gpt2_regex=False),
    "llama3-gpt2": lambda: tiny_tokenizer(LLAMA3, gpt2_regex=True),
}


def real_tokenizer(name: str):
    return load_tokenizer(packaged_or_skip(name))


@pytest.fixture(scope="module", params=list(TINY) + PACKAGED)
def tokenizer(request):
    return TINY[request.param]() if request.param in TINY else real_tokenizer(request.param)


def rendered_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The conversation rendered by the tokenizer's own template, after our system message."""
    messages = [{"role": "system", "content": BOOK_SYSTEM}] + messages
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def conversation(book: str, turns: list[tuple[str, str]], question: str) -> list[dict[str, str]]:
    """[user: book+SEPARATOR+q1, assistant: a1, user: q2, ...] ending with a user question."""
    messages = []
    for turn_idx, (asked, answered) in enumerate(turns):
        content = book.strip() + SEPARATOR + asked if turn_idx == 0 else asked
        messages += [{"role": "user", "content": content}, {"role": "assistant", "content": answered}]
    first = book.strip() + SEPARATOR + question if not turns else question
    return messages + [{"role": "user", "content": first}]


@pytest.mark.parametrize("book", [BOOK, "  \n" + BOOK + "\n\n  ", "1814. Kellynch!", "\"Anne\""])
@pytest.mark.parametrize("question", ["Who is Anne?", "1. List the sisters", "\"Why?\" ", " (a) or (b)"])
def test_first_turn_equals_rendered_template(tokenizer, book, question):
    chat = ChatFormat(tokenizer)
    ids = chat.document_ids(book) + chat.question_ids(question, is_first=True, previous_answer_ended=False)
    assert ids == rendered_ids(tokenizer, conversation(book, [], question.strip()))


def test_first_turn_on_a_real_book_excerpt(tokenizer):
    book = BOOK_PATH.read_text(encoding="utf-8")[:20_000]
    chat = ChatFormat(tokenizer)
    ids = chat.document_ids(book) + chat.question_ids("Who is Anne?", True, False)
    assert ids == rendered_ids(tokenizer, conversation(book, [], "Who is Anne?"))


@pytest.mark.parametrize("answers_ended", [True, False])  # stopped on end-of-turn / hit max tokens
def test_three_turns_equal_rendered_conversation(tokenizer, answers_ended):
    chat = ChatFormat(tokenizer)
    turns = [("Who is Sir Walter?", "A vain baronet."), ("And Anne?", "His daughter.\n\nShe is 27.")]
    ids = chat.document_ids(BOOK)
    for turn_idx, (question, answer) in enumerate(turns):
        ids += chat.question_ids(question, turn_idx == 0, previous_answer_ended=answers_ended)
        ids += chat.answer_ids(answer, has_ended=answers_ended)
    ids += chat.question_ids("Where is Kellynch?", False, previous_answer_ended=answers_ended)
    assert ids == rendered_ids(tokenizer, conversation(BOOK, turns, "Where is Kellynch?"))


def test_stop_ids_hold_eos_and_end_of_turn(tokenizer):
    chat = ChatFormat(tokenizer)
    assert tokenizer.eos_token_id in chat.stop_ids
    assert chat.end_of_turn_id in chat.stop_ids  # <|im_end|> / <|eot_id|>: ends the assistant turn
    assert tokenizer.convert_ids_to_tokens(chat.end_of_turn_id) in ("<|im_end|>", "<|eot_id|>")


def test_control_strings_in_user_text_never_become_control_tokens(tokenizer):
    chat = ChatFormat(tokenizer)
    control_ids = set(tokenizer.all_special_ids)
    control_ids |= {idx for idx, t in tokenizer.added_tokens_decoder.items() if t.special}
    hostile = " ".join(CONTROL_STRINGS + [t.content for t in tokenizer.added_tokens_decoder.values()])
    plain_doc, plain_q = chat.document_ids("x"), chat.question_ids("y", False, False)
    doc, question = chat.document_ids(hostile), chat.question_ids(hostile, False, False)

    def n_control(ids: list[int]) -> int:
        return sum(idx in control_ids for idx in ids)

    assert n_control(doc) == n_control(plain_doc)  # only the template's own control tokens
    assert n_control(question) == n_control(plain_q)
    assert hostile in tokenizer.decode(doc)  # the text itself survives, as text


def test_real_templates_survive_conversion():
    tokenizer = real_tokenizer("qwen2.5-coder-0.5b")
    assert "You are Qwen, created by Alibaba Cloud" in tokenizer.chat_template
    assert "<tool_call>" in tokenizer.chat_template  # the full upstream template, not a default


def test_the_system_message_keeps_answers_on_the_book_and_end_ids_stop(tokenizer):
    chat = ChatFormat(tokenizer, end_ids={7})
    assert chat.system == BOOK_SYSTEM and BOOK_SYSTEM in tokenizer.decode(chat.document_ids("x"))
    assert 7 in chat.stop_ids
    assert BOOK_SYSTEM not in tokenizer.decode(ChatFormat(tokenizer, system=None).document_ids("x"))


def test_qwen_stops_on_both_of_its_end_tokens():
    """<|im_end|> ends a turn; <|endoftext|> ends a document: Qwen's generation_config lists both."""
    from engine.loading import generation_defaults

    folder = packaged_or_skip("qwen2.5-coder-0.5b")
    tokenizer = load_tokenizer(folder)
    sampling, end_ids = generation_defaults("qwen2.5-coder-0.5b", folder)
    chat = ChatFormat(tokenizer, end_ids=end_ids)
    assert {tokenizer.convert_ids_to_tokens(i) for i in chat.stop_ids} == {"<|im_end|>", "<|endoftext|>"}
    assert sampling == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}
