"""The page's layout and event wiring (docs/DESIGN.md "What a user sees"), over `app.ui.App`'s handlers.

Left: upload with staged progress, the choice of a part of a too-long book, then the library;
centre: the chat, its tools and settings; right: live metrics and "where the model is reading";
above, the Model panel. `build` names every component a handler updates in `app.c`; `_wire`
connects events to handlers: loading one at a time on the engine's queue, answers side by side
(batched), and what only touches a reader's own cache (New chat, a saved chat) at once.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import gradio as gr

from app import book_view, outline_ui
from app.picker import NO_DRAFT, model_choices
from app.settings import INPUTS, TUNED
from app.views import Counters, render_metrics, render_plot, render_reading

if TYPE_CHECKING:
    from app.ui import App

ASSETS = Path(__file__).resolve().parent.parent / "assets"
FILE_TYPES = [".pdf", ".epub", ".txt", ".md", ".markdown", ".html", ".htm", ".docx"]
LONG_BOOKS_YARN = 4.0  # Qwen2.5's documented YaRN factor: 4 x 32,768 = 131,072 tokens
# no figure measured elsewhere: the time before a book is read is this machine's estimate (app/speeds.py)
LONG_BOOKS_NOTE = ("up to 4× the model's native context (131,072 tokens for Qwen2.5). Answers may get less "
                   "precise, also on short books, and a book that long takes far longer to read: the time "
                   "shown before a book is read is this machine's own estimate.")
NO_BOOK = "Upload a book, then ask about it."  # the empty chat's placeholder; with a book: `asking`
QUICK = {"Summarize the book": "Summarize the book in a few paragraphs.",
         "Who are the main characters?": "Who are the main characters? Describe each in one sentence."}


def asking(title: str) -> dict:
    """The empty chat of an open book: a placeholder that names it."""
    return gr.update(value=[], placeholder=f"*{title}* is read. Ask about it below, or try a quick question.")


def build(app: App) -> gr.Blocks:
    """The page: the Model panel over three columns; `app.c` names the components handlers update."""
    c, b = SimpleNamespace(), app.backend  # c: the components handlers update, by name
    app.c = c
    info = f"{b.where} · context {b.max_context:,} tokens"
    with gr.Blocks(title="BookChat") as demo:
        with gr.Row(elem_id="header", equal_height=True):
            gr.HTML(f"<div class='brand'>{(ASSETS / 'icon.svg').read_text()}<span>BookChat</span></div>",
                    elem_id="brand")
            gr.Markdown(info, elem_id="model-info")
        with gr.Accordion("Model", open=False, elem_id="model-picker"):
            c.models = gr.Markdown(app.model_table(), elem_id="models")
            with gr.Row():
                c.model = gr.Dropdown(model_choices(app.catalog), value=b.name, show_label=False,
                                      container=False, elem_id="model", scale=3, allow_custom_value=True,
                                      info="or type a local folder, a .gguf file or a hub id")
                c.draft = gr.Dropdown(label="Draft (same tokenizer)", elem_id="draft", scale=2, allow_custom_value=True,
                                      choices=app.draft_choices(b.name, wait=False),
                                      value=b.draft or NO_DRAFT)
                c.load_model = gr.Button("Load model", size="sm", elem_id="load-model", scale=1)
            c.long_books = gr.Checkbox(b.yarn_factor != 1, label=f"Long books: YaRN ×{LONG_BOOKS_YARN:g}",
                                       elem_id="long-books", info=LONG_BOOKS_NOTE,
                                       visible=b.can_load_models)  # else the server decides
            c.model_status = gr.Markdown("", elem_id="model-status")
        with gr.Row(equal_height=False):
            with gr.Column(scale=1, min_width=240, elem_id="left"):
                c.upload = gr.File(label="Add a book", file_types=FILE_TYPES, elem_id="upload", height=110)
                c.status = gr.Markdown("PDF, EPUB, TXT, Markdown, HTML or DOCX.", elem_id="doc-status")
                c.cancel = gr.Button("Cancel loading", elem_id="cancel-prefill", size="sm", visible=False)
                with gr.Group(visible=False) as c.password_row:
                    c.password = gr.Textbox(label="Password", type="password", elem_id="password")
                    c.unlock = gr.Button("Unlock", size="sm", elem_id="unlock")
                with gr.Group(visible=False, elem_id="fit") as c.fit_row:
                    c.first_n = gr.Slider(256, 4096, step=256, label="Keep the first N tokens", elem_id="first-n")
                    c.pick = gr.CheckboxGroup(label="…or pick chapters", elem_id="pick-chapters")
                    c.load_selection = gr.Button("Load this part", size="sm", elem_id="load-selection")
                gr.Markdown("#### Library", elem_classes="section-title")
                c.books = gr.Dropdown(label="Books read", elem_id="books", allow_custom_value=True)
                with gr.Row():
                    c.open_book = gr.Button("Open book", size="sm", elem_id="open-book")
                    c.remove_book = gr.Button("Remove…", size="sm", elem_id="remove-book", visible=not app.private)
                with gr.Group(visible=False, elem_id="remove-confirm") as c.confirm_row:
                    c.confirm_note = gr.Markdown("", elem_id="confirm-note")
                    with gr.Row():
                        c.confirm_remove = gr.Button("Remove", size="sm", variant="stop", elem_id="confirm-remove")
                        c.keep_book = gr.Button("Keep", size="sm", elem_id="keep-book")
                c.chats = gr.Dropdown(label="Chats about this book", elem_id="chats", allow_custom_value=True)
            with gr.Column(scale=3, min_width=480, elem_id="centre"):
                _centre(app, c)
            with gr.Column(scale=1, min_width=330, elem_id="right"):
                gr.Markdown("#### Live metrics", elem_classes="section-title")
                c.metrics = gr.Markdown(render_metrics("idle", None, None, Counters()), elem_id="metrics")
                c.plot = gr.HTML(render_plot([]), elem_id="plot")
                gr.Markdown("#### Where the model is reading", elem_classes="section-title")
                c.reading = gr.Markdown(render_reading(None, None), elem_id="reading")
        _wire(app, demo, c)
    return demo

def _centre(app: App, c: SimpleNamespace) -> None:
    c.title = gr.Markdown("### No book open", elem_id="book-title")
    c.chatbot = gr.Chatbot(elem_id="chatbot", height=430, show_label=False, buttons=["copy", "copy_all"],
                           feedback_options=None, placeholder=NO_BOOK)
    with gr.Row(elem_id="ask-row"):
        c.msg = gr.Textbox(placeholder="Ask about the book…", show_label=False, elem_id="msg", scale=6,
                           max_lines=6)
        c.send = gr.Button("Send", variant="primary", elem_id="send", scale=1, min_width=70)
        c.stop = gr.Button("Stop", variant="stop", elem_id="stop", scale=1, min_width=70)
    with gr.Row(elem_id="quick-row"):
        c.quick = [gr.Button(label, size="sm", elem_classes="quick") for label in QUICK]
        c.chapter = gr.Dropdown(show_label=False, container=False, elem_id="chapter", scale=2, min_width=140,
                                visible=False)
        c.summarize_chapter = gr.Button("Summarize chapter", size="sm", elem_id="summarize-chapter",
                                        visible=False)
    with gr.Row(elem_id="tools-row"):
        c.regenerate = gr.Button("↻ Regenerate", size="sm", elem_id="regenerate")
        c.edit = gr.Button("✎ Edit last", size="sm", elem_id="edit")
        c.clear = gr.Button("New chat", size="sm", elem_id="clear")
        c.export_md = gr.Button("Export .md", size="sm", elem_id="export-md")
        c.export_json = gr.Button("Export .json", size="sm", elem_id="export-json")
    c.export_file = gr.File(label="Exported chat", visible=False, elem_id="export-file", interactive=False)
    book_view.add(c)  # the answer's sources, clickable, and the book view (app/book_view.py)
    outline_ui.panel(app, c)  # the outline and book summary (app/outline_ui.py)
    start, c.settings = app.start_sampling(), {}  # c.settings: the controls by app/settings.py name
    with gr.Accordion("Settings", open=False, elem_id="settings"):
        c.sampling_note = gr.Markdown(app.sampling_note(), elem_id="sampling-note")
        with gr.Row():
            c.settings["temperature"] = gr.Slider(0, 1.5, value=start.temperature, step=0.05,
                                                  label="Temperature (0: greedy)")
            c.settings["top_p"] = gr.Slider(0.05, 1.0, value=start.top_p, step=0.05, label="Top-p")
            c.settings["top_k"] = gr.Slider(0, 100, value=start.top_k, step=1, label="Top-k (0: off)")
            c.settings["min_p"] = gr.Slider(0, 0.5, value=start.min_p, step=0.01, label="Min-p (0: off)")
        with gr.Row():
            c.settings["repetition_penalty"] = gr.Slider(1.0, 1.5, value=start.repetition_penalty, step=0.01,
                                                         label="Repetition penalty (1: off)")
            c.settings["presence_penalty"] = gr.Slider(-2, 2, value=start.presence_penalty, step=0.05,
                                                       label="Presence penalty")
            c.settings["frequency_penalty"] = gr.Slider(-2, 2, value=start.frequency_penalty, step=0.05,
                                                        label="Frequency penalty")
        with gr.Row():
            c.settings["max_new_tokens"] = gr.Slider(1, 2048, value=start.max_new_tokens, step=1,
                                                     label="Max new tokens", elem_id="max-new")
            c.settings["seed"] = gr.Number(value=start.seed, precision=0, label="Seed")
            c.settings["levels"] = gr.Dropdown(app.backend.level_stacks(), value=app.backend.levels,
                                               label="Level stack", elem_id="levels")
            c.defaults = gr.Button("Model's defaults", size="sm", elem_id="defaults")
        c.settings["reread"] = gr.Checkbox(False, label="Re-read the sources before answering", elem_id="reread",
                                           info="The passages the question's attention goes to most are quoted "
                                                "after it: more to read before the first token (README: the "
                                                "prompt, exactly).")


def _wire(app: App, demo: gr.Blocks, c: SimpleNamespace) -> None:
    loading = [c.status, c.upload, c.cancel, c.password_row, c.fit_row, c.first_n, c.pick, c.chatbot, c.metrics,
               c.plot, c.reading, c.chapter, c.summarize_chapter, c.title, c.models, c.books, c.chats, c.sources]
    answering = [c.msg, c.chatbot, c.metrics, c.plot, c.reading, c.books, c.chats, c.sources]
    # Loading is one at a time: while another user's load runs, "queue: 2/3" shows on the status
    # (loading) or the metrics (answering) panel; "minimal" adds no overlay to streamed outputs.
    engine = dict(concurrency_id="engine", concurrency_limit=1, show_progress="minimal")
    load, job = dict(engine, show_progress_on=[c.status]), dict(engine, show_progress_on=[c.metrics])
    # Answers run side by side, batched by the engine (engine/batch.py); loading stays one at a time.
    answer = dict(job, concurrency_id="answer", concurrency_limit=app.batcher.max_active)
    # New chat and opening a saved chat only truncate the reader's own cache: they never wait
    # behind another reader's prefill, which on a busy desktop can take minutes.
    instant = dict(show_progress="minimal", show_progress_on=[c.metrics], concurrency_limit=None)
    c.upload.upload(app.load_book, [c.upload, c.password], loading, api_name="load_book", **load)
    gr.on([c.unlock.click, c.password.submit], app.unlock, [c.password], loading, api_name="unlock", **load)
    c.load_selection.click(app.load_selection, [c.first_n, c.pick], loading, api_name="load_selection", **load)
    gr.on([c.first_n.change, c.pick.change], app.selection_note, [c.first_n, c.pick], c.load_selection,
          api_name=False, show_progress="hidden", concurrency_limit=None)
    c.open_book.click(app.open_saved, [c.books], loading, api_name="open_book", **load)
    c.remove_book.click(app.ask_remove, [c.books], [c.status, c.confirm_note, c.confirm_row],
                        api_name="ask_remove_book", **instant)
    removed = [c.status, c.confirm_row, c.chatbot, c.title, c.metrics, c.plot, c.reading, c.chapter,
               c.summarize_chapter, c.books, c.chats]
    c.confirm_remove.click(app.remove_saved, [c.books], removed, api_name="remove_book", **instant)
    c.keep_book.click(lambda: gr.update(visible=False), None, c.confirm_row, api_name=False)
    settings = [c.settings[name] for name in INPUTS]  # the order the `ask` and `regenerate` handlers take them in
    reset = [c.settings[name] for name in (*TUNED, "levels")]  # what "Model's defaults" puts back
    switched = [c.model_status, c.models, c.title, c.chatbot, c.sampling_note, c.status, *reset]
    c.load_model.click(app.switch_model, [c.model, c.long_books, c.draft], switched, api_name="load_model", **load)
    c.model.input(app.drafts_offered, c.model, c.draft, api_name=False)  # the drafts that pair with it
    c.defaults.click(app.reset_settings, None, reset, api_name=False)
    c.cancel.click(app.request_stop, None, None, api_name="cancel_prefill", concurrency_limit=None)
    gr.on([c.send.click, c.msg.submit], app.ask, [c.msg, c.chatbot, *settings], answering, api_name="ask", **answer)
    c.stop.click(app.request_stop, None, None, api_name="stop", concurrency_limit=None)
    c.regenerate.click(app.regenerate, settings, answering, api_name="regenerate", **answer)
    quick = [(b, lambda q=q: q, None) for b, q in zip(c.quick, QUICK.values(), strict=True)]
    quick.append((c.summarize_chapter, lambda chapter: f"Summarize {chapter}." if chapter else "", c.chapter))
    for button, question, source in quick:  # fill the box, then ask as if typed
        button.click(question, source, c.msg, api_name=False).then(
            app.ask, [c.msg, c.chatbot, *settings], answering, api_name=False, **answer)
    c.edit.click(app.edit_last, None, [c.msg], api_name="edit_last")
    gr.on([c.clear.click, c.chatbot.clear], app.clear, None,
          [c.chatbot, c.metrics, c.plot, c.books, c.chats, c.sources], api_name="clear",
          **instant)  # the chatbot's own trash button starts a new chat too
    for button, fmt in ((c.export_md, "md"), (c.export_json, "json")):
        button.click(app.export_file, gr.State(fmt), c.export_file, api_name=False)
    c.chats.input(app.open_chat, [c.chats], [c.chatbot, c.metrics, c.sources], api_name="open_chat", **instant)
    book_view.wire(app, c)
    outline_ui.wire(app, c)
    gr.api(app.export, api_name="export")
    gr.api(app.engine_counters, api_name="engine_counters")
    demo.load(app.show_library, None, [c.books, c.chats], api_name=False)
    demo.load(app.refresh_picker, None, [c.models, c.model, c.draft], api_name=False)  # measured, found since
    demo.unload(app.forget)
