"""app/server.py's queue pacing: Gradio's private attributes are there, and set (or said when not)."""

import gradio as gr

from app.server import pace_queue


def test_the_queue_polls_at_windows_pace_on_this_gradio():
    demo = gr.Blocks()
    demo.queue()
    said = []
    assert pace_queue(demo, said.append)  # fails when a Gradio upgrade renames the attributes
    assert (demo._queue.sleep_when_free, demo._queue.progress_update_sleep_when_free) == (0.05, 0.1)
    assert said == []


def test_a_gradio_without_the_attributes_is_said_and_the_app_still_starts():
    demo = gr.Blocks()
    demo.queue()
    del demo._queue.sleep_when_free
    said = []
    assert not pace_queue(demo, said.append)
    assert "polls at its own pace" in said[0]
    assert not hasattr(demo._queue, "sleep_when_free")
