"""The app's API through gradio_client, against `python app.py --model smollm2-135m` started here.

Upload and prefill a few pages of Persuasion, a streamed answer with metrics and reading
passages, Stop, Regenerate, Edit, a second question that reuses the prefill (the session's engine counters),
a bad file that leaves the open book alone, a too-long book that waits for the user's choice,
per-client isolation, and reopening a saved book from its snapshot.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from app import child
from tests.conftest import packaged_or_skip

ROOT = Path(__file__).resolve().parents[2]
ART = Path(os.environ.get("E2E_ARTIFACTS", ROOT / "tests" / "e2e" / "artifacts"))
LEVELS = "ngram>retrieval>full"
pytest.importorskip("gradio_client")


def start_app(args: list[str], log_path: Path):
    """`python app.py ARGS` on a free port (app/child.py), one thread; skips without SmolLM2."""
    packaged_or_skip("smollm2-135m")
    return child.start_app(args, log_path, env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    library = tmp_path_factory.mktemp("library")
    # the module's tests open books from many clients, in any order (xdist): none is closed for room
    proc, url = start_app(["--model", "smollm2-135m", "--threads", "1", "--library", str(library),
                           "--max-open-books", "32"], ART / "app-api.log")
    yield url
    child.stop(proc)


@pytest.fixture(scope="module")
def small_book(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("books") / "persuasion-start.txt"
    path.write_text((ROOT / "assets" / "persuasion.txt").read_text(encoding="utf-8")[:4500], encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def loaded(app_url, small_book):
    from gradio_client import Client, handle_file

    client = Client(app_url, verbose=False)
    return client, client.predict(handle_file(str(small_book)), "", api_name="/load_book")


def ask(client, question: str, max_new_tokens: int = 10):
    job = client.submit(question, [], 0.0, 1.0, max_new_tokens, 0, LEVELS, api_name="/ask")
    updates = list(job)
    return job.result(), updates


def text_of(message: dict) -> str:
    content = message["content"]
    return content if isinstance(content, str) else " ".join(block.get("text", "") for block in content)


def counters(client) -> dict:
    return client.predict(api_name="/engine_counters")


def test_upload_tokenizes_against_the_context_and_prefills_once(loaded):
    client, result = loaded
    status = result[0]
    assert "tokens of 7,168 — fits" in status and "Ready" in status, status
    assert counters(client)["n_prefills"] == 1


def test_answer_streams_with_metrics_and_reading_passages(loaded):
    client, _ = loaded
    (msg, chatbot, metrics, *_), updates = ask(client, "Who is Sir Walter Elliot?")
    assert len(updates) > 2  # "thinking", then one update per engine step, then the final one
    assert text_of(chatbot[-2]) == "Who is Sir Walter Elliot?" and text_of(chatbot[-1]).strip()
    assert "done" in metrics and "tokens/s" in metrics and "TBT now" in metrics and "| full |" in metrics
    readings = [u[4] for u in updates if isinstance(u[4], str) and "passage" in u[4]]
    assert readings, "no 'where the model is reading' update while streaming"


def test_second_question_reuses_the_prefill(loaded):
    client, _ = loaded
    before = counters(client)
    ask(client, "Where is Kellynch Hall?")
    after = counters(client)
    assert after["n_prefills"] == before["n_prefills"] == 1
    assert after["n_prefill_tokens"] - before["n_prefill_tokens"] < 100  # only the question went in


def test_stop_ends_the_answer_within_a_step_and_the_book_still_answers(loaded):
    client, _ = loaded
    job = client.submit("Tell me the whole story of the Elliot family.", [], 0.0, 1.0, 400, 0, LEVELS, api_name="/ask")
    deadline = time.time() + 60
    while len(job.outputs()) < 3 and not job.done():
        assert time.time() < deadline
        time.sleep(0.05)
    stopped_at = time.time()
    client.predict(api_name="/stop")
    _, chatbot, metrics, *_ = job.result()
    assert "stopped" in metrics and time.time() - stopped_at < 15
    assert "(stopped)" in text_of(chatbot[-1])
    (_, _, metrics, *_), _ = ask(client, "Who is Anne?", 4)
    assert "done" in metrics


def test_regenerate_replaces_the_last_answer(loaded):
    client, _ = loaded
    (_, chatbot, *_), _ = ask(client, "Who is Anne?", 8)
    _, regenerated, metrics, *_ = client.predict(0.0, 1.0, 8, 0, LEVELS, api_name="/regenerate")
    assert len(regenerated) == len(chatbot) and "done" in metrics
    assert text_of(regenerated[-1]) == text_of(chatbot[-1])  # greedy: the same answer again


def test_edit_last_then_send_replaces_the_question(loaded):
    client, _ = loaded
    (_, chatbot, *_), _ = ask(client, "Who is Mary?", 4)
    assert client.predict(api_name="/edit_last")["value"] == "Who is Mary?"
    (_, edited, *_), _ = ask(client, "Who is Elizabeth?", 4)
    assert len(edited) == len(chatbot) and text_of(edited[-2]) == "Who is Elizabeth?"


def test_bad_file_keeps_the_open_book_and_its_chat(loaded, tmp_path):
    from gradio_client import handle_file

    client, _ = loaded
    before, n_prefills = client.predict("md", api_name="/export"), counters(client)["n_prefills"]
    fake = tmp_path / "chapter.txt"
    fake.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8)
    status = client.predict(handle_file(str(fake)), "", api_name="/load_book")[0]
    assert "PNG image" in status and "is still open" in status
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert "empty" in client.predict(handle_file(str(empty)), "", api_name="/load_book")[0]
    assert client.predict("md", api_name="/export") == before and counters(client)["n_prefills"] == n_prefills


def test_too_long_book_waits_for_a_choice_then_loads_the_beginning(app_url, tmp_path):
    from gradio_client import Client, handle_file

    client = Client(app_url, verbose=False)
    book = tmp_path / "persuasion.txt"
    book.write_text((ROOT / "assets" / "persuasion.txt").read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    n_prefills = counters(client)["n_prefills"]
    status = client.predict(handle_file(str(book)), "", api_name="/load_book")[0]
    assert "of 7,168 — too long by" in status and "Choose what to read" in status
    assert "Long books" in status and "takes far longer to read" in status  # the way to a longer context, its cost
    assert "minutes" not in status.split("Long books")[1]  # no figure measured on another machine
    assert counters(client)["n_prefills"] == n_prefills  # nothing was prefilled or cut silently
    status = client.predict(512, [], api_name="/load_selection")[0]  # no chapter ticked: the beginning
    assert "first 512 tokens" in status and "Ready" in status
    assert counters(client)["n_prefills"] == n_prefills + 1


def test_password_pdf_asks_for_the_password_and_opens_with_it(app_url):
    from gradio_client import Client, handle_file

    assets = Path(os.environ.get("BOOKCHAT_CACHE", Path.home() / ".cache" / "bookchat")) / "assets"
    pdf = assets / "r3-user-password.pdf"  # pypdf's test file, password "asdfzxcv" (.ci/fetch_assets.sh)
    if not pdf.is_file():
        pytest.skip(f"{pdf} is missing: run `bash .ci/fetch_assets.sh`")
    client = Client(app_url, verbose=False)
    assert "protected by a password" in client.predict(handle_file(str(pdf)), "", api_name="/load_book")[0]
    assert "does not open this PDF" in client.predict("wrong", api_name="/unlock")[0]
    assert "Ready" in client.predict("asdfzxcv", api_name="/unlock")[0]


def test_clients_are_isolated_and_a_saved_book_reopens_from_its_snapshot(loaded, app_url, small_book):
    from gradio_client import Client

    from app.documents import load_document
    from app.library import text_sha256

    client, _ = loaded
    ask(client, "Who is Anne?", 4)  # a chat of the first client, autosaved (whatever ran before here)
    book_id = text_sha256(load_document(small_book).text)[:16]  # the library's id of that text
    other = Client(app_url, verbose=False)
    assert other.predict("md", api_name="/export") == ""  # another session sees no book, no chat
    assert counters(other) == {"n_prefills": 0, "n_prefill_tokens": 0}  # nor the first one's counters
    reopened = other.predict(book_id, api_name="/open_book")
    assert "restored from the saved snapshot" in reopened[0] and counters(other)["n_prefills"] == 0
    assert "**You:**" not in other.predict("md", api_name="/export")  # a fresh chat, not the other user's
    chats = reopened[-2]["choices"]  # the outputs end with the chats, then the sources
    assert chats, "the first client's autosaved chats are listed with the book"


@pytest.fixture(scope="module")
def longer_book(tmp_path_factory) -> Path:
    """6,281 SmolLM2 tokens of Persuasion: a reading of two parts (4,096 tokens a part)."""
    path = tmp_path_factory.mktemp("books") / "persuasion-longer.txt"
    path.write_text((ROOT / "assets" / "persuasion.txt").read_text(encoding="utf-8")[:26000], encoding="utf-8")
    return path


def reading_in_its_second_part(url: str, book: Path):
    """A client and its job loading `book`, once the reading is past its first part."""
    from gradio_client import Client, handle_file

    client = Client(url, verbose=False)
    job = client.submit(handle_file(str(book)), "", api_name="/load_book")
    deadline = time.time() + 180
    while not any(re.search(r"chunk (9|1\d) of", str(out[0])) for out in job.outputs()):
        assert not job.done() and time.time() < deadline, job.outputs()[-1:]
        time.sleep(0.05)
    return client, job


def test_a_stopped_reading_is_kept_and_the_book_reads_on_from_there(app_url, longer_book):
    """Stop while a book longer than one part (4,096 tokens) is read: the reading so far is kept, and
    opening the book again reads only the rest."""
    from app.documents import load_document
    from app.library import text_sha256

    path = longer_book
    client, job = reading_in_its_second_part(app_url, path)
    client.predict(api_name="/cancel_prefill")
    status = job.result()[0]
    stopped = re.search(r"Stopped after reading \d+% of the book \(([\d,]+) of ([\d,]+) tokens\)", status)
    assert stopped and "open it again to read on from there" in status, status
    n_read, n_total = (int(n.replace(",", "")) for n in stopped.groups())
    assert 4096 < n_read < n_total and n_read % 512 == 0 and counters(client)["n_prefills"] == 0

    status = client.predict(text_sha256(load_document(path).text)[:16], api_name="/open_book")[0]
    assert "was read before" in status and f"after the {n_read:,} a stopped reading had kept" in status, status
    assert counters(client) == {"n_prefills": 1, "n_prefill_tokens": n_total - n_read}


def test_an_app_shut_down_mid_reading_saves_it_and_the_next_start_reads_on(tmp_path, longer_book):
    """A kill (SIGTERM: a closed terminal, a logout) while a book is read: the app saves the reading
    before it exits, and the library of the next start has it."""
    from app.documents import load_document
    from app.library import Library, text_sha256

    library = tmp_path / "library"
    proc, url = start_app(["--model", "smollm2-135m", "--threads", "1", "--library", str(library)],
                          ART / "app-api-shutdown.log")
    try:
        reading_in_its_second_part(url, longer_book)
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(120) == 0
    finally:
        child.stop(proc)
    assert "Saving the reading under way" in (ART / "app-api-shutdown.log").read_text()
    assert Library(library).n_read(text_sha256(load_document(longer_book).text)[:16]) > 4096


def test_remove_names_what_it_deletes_then_deletes_the_book_and_closes_it(app_url, tmp_path):
    from gradio_client import Client, handle_file

    from app.documents import load_document
    from app.library import text_sha256

    path = tmp_path / "chapter-two.txt"
    path.write_text((ROOT / "assets" / "persuasion.txt").read_text(encoding="utf-8")[4500:8000], encoding="utf-8")
    reader, other = Client(app_url, verbose=False), Client(app_url, verbose=False)
    assert "Ready" in reader.predict(handle_file(str(path)), "", api_name="/load_book")[0]
    book_id = text_sha256(load_document(path).text)[:16]
    assert "open in another window" in other.predict(book_id, api_name="/ask_remove_book")[0]
    assert "open in another window" in other.predict(book_id, api_name="/remove_book")[0]
    _, note = reader.predict(book_id, api_name="/ask_remove_book")  # (status, note): a group has no value
    assert re.search(r"Remove \*\*chapter-two\*\* from the library, with its 0 chats and its saved reading "
                     r"\(\d+ MB\)\? The file you uploaded is not touched\.", note), note

    status, chatbot, title, *_, books, _ = reader.predict(book_id, api_name="/remove_book")
    assert re.search(r"Removed \*chapter-two\* from the library: \d+ MB freed\.", status), status
    assert chatbot == {"__type__": "update", "value": [], "placeholder": "Upload a book, then ask about it."}
    assert "No book open" in title
    assert book_id not in [value for _, value in books["choices"]]
    assert "Pick a book" in reader.predict(book_id, api_name="/ask_remove_book")[0]


def test_clear_starts_an_empty_chat(loaded):
    client, _ = loaded
    chatbot, metrics, *_ = client.predict(api_name="/clear")
    assert chatbot == [] and "ready" in metrics
    assert "**You:**" not in client.predict("md", api_name="/export")


def test_an_unknown_model_gets_a_message_and_the_open_book_stays(loaded):
    client, _ = loaded
    status, models_table, *_ = client.predict("/nowhere/such-model", api_name="/load_model")
    assert "Could not load" in status and "smollm2-135m` stays loaded" in status, status
    assert "qwen2.5-coder-1.5b" in models_table and "measured on this machine" in models_table
    assert "tokens/s prefill" in models_table  # this app's prefill was recorded for smollm2-135m
    (_, _, metrics, *_), _ = ask(client, "Who is Anne?", 4)
    assert "done" in metrics


def test_every_sampling_setting_reaches_the_engine_and_out_of_range_is_refused(loaded):
    """The sliders' ranges are SamplingConfig's valid ranges, so Gradio refuses what the engine would."""
    from gradio_client.exceptions import AppError

    client, _ = loaded
    (_, before, *_), _ = ask(client, "Who is Anne?", 4)
    with pytest.raises(AppError, match="less than minimum"):
        client.predict("Who is Anne?", [], 0.7, 0.9, 4, 0, LEVELS, -1, 0.0, 1.0, 0.0, 0.0, api_name="/ask")
    (_, after, *_), _ = ask(client, "Who is Anne?", 4)
    assert len(after) == len(before) + 2  # the refused question left the chat alone
    before = after
    job = client.submit("Who is Anne?", [], 0.7, 0.9, 4, 0, LEVELS, 20, 0.05, 1.1, 0.5, 0.5, api_name="/ask")
    _, chatbot, metrics, *_ = job.result()  # penalties, min-p and top-k on: an answer
    assert "done" in metrics and len(chatbot) == len(before) + 2


def test_long_books_reloads_the_model_with_four_times_the_context(small_book, tmp_path):
    """Long books reloads the model with YaRN x4, and the book opens in a 4x budget. Its own app:
    the reload closes every open book, which would break the other tests' shared app."""
    from gradio_client import Client

    proc, url = start_app(["--model", "smollm2-135m", "--threads", "1", "--library", str(tmp_path / "library")],
                          ART / "app-api-long-books.log")
    try:
        check_long_books(Client(url, verbose=False), small_book)
    finally:
        child.stop(proc)


def check_long_books(client, small_book):
    from gradio_client import handle_file

    status, models_table, *_ = client.predict("smollm2-135m", True, api_name="/load_model")
    assert "`smollm2-135m` is loaded" in status, status
    status = client.predict(handle_file(str(small_book)), "", api_name="/load_book")[0]
    assert "of 31,744 — fits" in status and "Ready" in status, status  # 4 x 8,192 - 1,024 kept for the chat
    (_, chatbot, metrics, *_), _ = ask(client, "Who is Anne?", 4)
    assert "done" in metrics and len(chatbot) == 2
    status, *_ = client.predict("smollm2-135m", True, api_name="/load_model")
    assert "already loaded for long books" in status
