"""The engine's face: bad input gives typed errors with numbers a person can act on; prefill
progress and cancellation leave the engine usable; events carry stats and reading positions;
a prefill snapshot restores a session that answers like the original."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.config import Cancelled, DocumentTooLong, EmptyPrompt, EngineConfig, SamplingConfig
from tests.conftest import tiny_engine
from tests.engine.test_speculative import random_ids


def answer(session, q, **kw):
    return [t for e in session.ask(q, SamplingConfig(max_new_tokens=kw.pop("n", 10)), **kw) for t in e.tokens]


def test_empty_document_and_question_are_refused():
    engine = tiny_engine("ngram>retrieval>full")
    with pytest.raises(EmptyPrompt, match="document is empty"):
        engine.open([])
    session = engine.open(random_ids(20, 128, 0))
    with pytest.raises(EmptyPrompt, match="question is empty"):
        list(session.ask([]))


def test_too_long_prompt_names_both_numbers():
    engine = tiny_engine("plain")
    from dataclasses import replace
    engine.target.config = replace(engine.target.config, max_positions=64)
    with pytest.raises(DocumentTooLong, match="100 tokens but the model's context holds 64"):
        engine.open(random_ids(99, 128, 1))
    session = engine.open(random_ids(50, 128, 1))
    with pytest.raises(DocumentTooLong, match="71 tokens .* holds 64"):
        list(session.ask(random_ids(20, 128, 2)))
    assert len(answer(session, random_ids(3, 128, 2), n=100)) == 64 - 50 - 3  # stops at the end


def test_cancel_during_prefill_raises_and_the_engine_stays_usable():
    engine = tiny_engine("ngram>retrieval>full")
    cancel, seen = threading.Event(), []

    def progress(done, total):
        seen.append((done, total))
        if done >= 14:
            cancel.set()

    with pytest.raises(Cancelled):
        engine.open(random_ids(60, 128, 3), on_progress=progress, cancel=cancel)
    assert seen[:2] == [(7, 60), (14, 60)] and engine.n_prefills == 0
    session = engine.open(random_ids(60, 128, 3))
    assert len(answer(session, random_ids(4, 128, 4))) == 10 and engine.n_prefills == 1


def test_cancel_during_generation_stops_within_one_step():
    session = tiny_engine("ngram>retrieval>full").open(random_ids(60, 128, 5))
    cancel, events = threading.Event(), []
    for event in session.ask(random_ids(4, 128, 6), SamplingConfig(max_new_tokens=50), cancel=cancel):
        events.append(event)
        if len(events) == 2:
            cancel.set()
    assert len(events) == 3 and events[-1].finish_reason == "cancelled" and events[-1].tokens == []
    assert len(answer(session, random_ids(3, 128, 7))) == 10  # the session still answers


def test_stop_token_ends_the_answer_and_stays_in_the_history():
    session = tiny_engine("ngram>full").open(random_ids(60, 128, 8))
    q = random_ids(4, 128, 9)
    free = answer(session, q, n=12)
    session.truncate(60)
    stop = free[5]
    events = list(session.ask(q, SamplingConfig(max_new_tokens=12), stop_ids={stop}))
    tokens = [t for e in events for t in e.tokens]
    assert tokens == free[: free.index(stop) + 1] and events[-1].finish_reason == "stop"
    assert session.tokens[-1] == stop


def test_events_carry_level_stats_and_reading_positions():
    session = tiny_engine("ngram>retrieval>full").open(random_ids(200, 128, 10))
    events = list(session.ask(random_ids(5, 128, 11), SamplingConfig(max_new_tokens=30)))
    last = events[-1]
    assert [s.name for s in last.stats.levels] == ["retrieval", "full"]
    full = last.stats.levels[-1]
    assert full.n_emitted == last.stats.n_tokens == 30 and last.finish_reason == "length"
    assert 0 <= full.acceptance <= 1 and full.tokens_per_check >= 1 and last.stats.tbt_ms_mean > 0
    reading = events[0].reading
    assert reading and all(0 <= a < b <= 205 for a, b, _ in reading)
    assert abs(sum(w for *_, w in reading) - 1) < 1e-9 or len(reading) == 12


def test_snapshot_restores_a_session_that_answers_the_same(tmp_path):
    engine = tiny_engine("ngram>retrieval>full")
    doc, q = random_ids(80, 128, 12), random_ids(4, 128, 13)
    session = engine.open(doc)
    session.save(tmp_path / "snap.pt", meta={"doc": "x"})
    want = answer(session, q)
    restored = engine.restore(tmp_path / "snap.pt")
    assert answer(restored, q) == want and engine.n_prefills == 1


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_a_reading_stopped_saved_and_taken_up_again_equals_one_read(tmp_path, dtype):
    """A long book read in parts, stopped mid-part, saved and continued from the snapshot holds the
    KV and answers of one uninterrupted read, bit for bit: parts start at chunk boundaries (7
    tokens here), so every forward is the one the uninterrupted read makes (a forward's rounding
    depends on its rows: parts cut off the boundaries fail this test)."""
    engine = tiny_engine("ngram>retrieval>full", dtype=dtype)
    doc, q = random_ids(90, 128, 14), random_ids(4, 128, 15)
    whole = engine.open(doc)
    want = answer(whole, q, n=12)

    part = engine.open(doc, n_first=14)  # room for all 90 tokens, 14 read now
    assert part.tokens == doc[:14] and part.full.length == 14
    cancel = threading.Event()
    with pytest.raises(Cancelled):  # stopped after the second chunk of this part: 14 + 14 kept
        part.read(doc[14:70], on_progress=lambda done, total: done >= 14 and cancel.set(), cancel=cancel)
    assert part.tokens == doc[:28] and part.full.length == 28
    part.save(tmp_path / "partial.pt")
    again = engine.restore(tmp_path / "partial.pt", n_total=90)  # allocated for all 90 at once
    capacity = again.full.capacity
    again.read(doc[28:])
    assert again.full.capacity == capacity == whole.full.capacity  # no growth: on a GPU, no second copy
    assert again.tokens == doc and torch.equal(again.full.k[..., :90, :], whole.full.k[..., :90, :])
    assert torch.equal(again.full.v[..., :90, :], whole.full.v[..., :90, :])
    assert answer(again, q, n=12) == want
    with pytest.raises(ValueError, match="before the first question"):
        again.read(doc[:7])
    assert engine.n_prefills == 2  # a reading taken up again is not another document


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
@pytest.mark.parametrize(("n_saved", "n_shared"), [(40, 40), (90, 33)], ids=["shorter-read-before", "longer"])
def test_a_document_that_begins_as_a_saved_one_reads_only_the_rest(tmp_path, dtype, n_saved, n_shared):
    """The first 40 tokens of a book read before its first 60 (or 90 tokens of another text that
    shares its first 33): the whole 7-token chunks they share are restored, the rest is read, and
    the KV and answer are those of one reading of the new document, bit for bit."""
    engine = tiny_engine("ngram>retrieval>full", dtype=dtype)
    doc, q = random_ids(60, 128, 16), random_ids(4, 128, 17)
    whole = engine.open(doc)
    want = answer(whole, q, n=12)
    saved = doc[:n_shared] + random_ids(n_saved - n_shared, 128, 18)
    engine.open(saved).save(tmp_path / "other.pt")

    again = engine.restore(tmp_path / "other.pt", n_total=len(doc), doc_ids=doc)
    n_kept = n_shared - n_shared % 7  # whole chunks of 7
    assert again.tokens == doc[:n_kept] and again.full.length == n_kept
    again.read(doc[n_kept:])
    assert again.tokens == doc and torch.equal(again.full.k[..., :60, :], whole.full.k[..., :60, :])
    assert torch.equal(again.full.v[..., :60, :], whole.full.v[..., :60, :])
    assert answer(again, q, n=12) == want
    with pytest.raises(ValueError, match="share no whole prefill chunk"):
        engine.restore(tmp_path / "other.pt", doc_ids=random_ids(60, 128, 19))


def test_config_errors_say_what_to_do():
    with pytest.raises(ValueError, match="choose one of"):
        EngineConfig(levels="ngram>draft")
    with pytest.raises(ValueError, match="needs a draft model"):
        EngineConfig(target="smollm2-135m", levels="draft>full")
    with pytest.raises(ValueError, match="yarn_factor"):
        EngineConfig(yarn_factor=0.5)
    for bad, field in [(dict(top_p=0), "top_p"), (dict(temperature=-1), "temperature"), (dict(top_k=-1), "top_k"),
                       (dict(repetition_penalty=0), "repetition_penalty"), (dict(min_p=1), "min_p"),
                       (dict(presence_penalty=3), "presence_penalty")]:
        with pytest.raises(ValueError, match=field):
            SamplingConfig(**bad)


def test_the_default_is_the_1_5b_with_the_0_5b_drafting_and_other_targets_draft_nothing():
    on_gpu = EngineConfig(device="cuda")  # a config only: no GPU needed
    assert (on_gpu.target, on_gpu.draft, on_gpu.levels) == ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b",
                                                            "draft>retrieval>full")
    # on a CPU the int8 middle level alone measured fastest; the draft is loaded for a switch
    assert (EngineConfig(device="cpu").draft, EngineConfig(device="cpu").levels) == ("qwen2.5-coder-0.5b",
                                                                                       "retrieval>full")
    alone = EngineConfig(target="qwen2.5-coder-0.5b", device="cpu")
    assert (alone.draft, alone.levels) == (None, "ngram>retrieval>full")
    assert EngineConfig(target="qwen2.5-coder-0.5b", device="cuda").levels == "ngram>retrieval>full"
    assert EngineConfig(target="smollm2-135m", draft=None, levels="plain").levels == "plain"


def test_middle_level_equals_the_top_when_the_document_fits_its_budget():
    """With the whole prompt in the retrieval cache, the middle level is the target itself at
    the right positions: in greedy decoding the top accepts every token it drafts."""
    from engine.config import RetrievalConfig

    retrieval = RetrievalConfig(budget_tokens=512, sink_tokens=4, window_tokens=16, chunk_tokens=4)
    session = tiny_engine("retrieval>full", retrieval=retrieval).open(random_ids(150, 128, 14))
    events = list(session.ask(random_ids(5, 128, 15), SamplingConfig(max_new_tokens=30)))
    full = events[-1].stats.levels[-1]
    assert full.n_tested > 0 and full.acceptance == 1.0


@pytest.mark.parametrize(("flags", "dtype", "layout"), [
    ({"avx2"}, torch.float32, "packed"),  # no bf16 instructions: float32, oneDNN-packed
    ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16, "packed"),  # Zen 4: bf16, packed
    ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, torch.bfloat16, "as loaded"),  # AMX: as measured there
])
def test_auto_dtype_and_weight_layout_follow_the_cpus_instructions(flags, dtype, layout, monkeypatch):
    from engine import device

    monkeypatch.setattr(device, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(device, "can_pack_linear_weights", lambda dtype: True)
    cpu = torch.device("cpu")
    assert device.pick_dtype("auto", cpu) == dtype and device.pick_dtype("float32", cpu) == torch.float32
    assert device.linear_layout(cpu, dtype) == layout
    assert device.linear_layout(cpu, torch.float32) == "packed"
    monkeypatch.setattr(device, "cpu_linear_kernel", lambda: object())
    assert device.linear_layout(cpu, torch.float32, weights_fit_bf16=True) == "bf16-stored"
    assert device.linear_layout(cpu, torch.bfloat16, weights_fit_bf16=True) == device.linear_layout(cpu, torch.bfloat16)
    assert device.linear_layout(torch.device("meta"), torch.float32, weights_fit_bf16=True) == "as loaded"
    monkeypatch.setattr(device, "cpu_linear_kernel", lambda: None)  # the kernel did not build
    assert device.linear_layout(cpu, torch.float32, weights_fit_bf16=True) == "packed"
    if "avx512_bf16" not in flags:  # bf16 asked for on a CPU without bf16 dot products
        assert device.linear_layout(cpu, torch.bfloat16) == "as loaded"
    monkeypatch.setattr(device, "can_pack_linear_weights", lambda dtype: False)  # oneDNN cannot
    assert device.linear_layout(cpu, dtype) == "as loaded"


def test_this_cpus_flags_are_read():
    from engine import device

    flags = device.cpu_flags()
    assert not flags or "fpu" in flags or "sse2" in flags  # x86 /proc/cpuinfo, or nothing elsewhere


@pytest.mark.parametrize("layout", ["packed", "bf16-stored"])
@pytest.mark.parametrize("levels", ["ngram>retrieval>full", "draft>retrieval>full"])
def test_float32_on_cpu_lays_weights_out_for_the_cpu_and_stays_lossless(levels, layout, monkeypatch):
    """float32 on CPU takes bf16-stored linears where the weights are bf16 values, else
    oneDNN-packed ones (engine/device.py), for the target and the draft; speculation over
    either still gives plain decoding's greedy answer."""
    from engine import session as engine_module
    from engine.device import can_pack_linear_weights, cpu_linear_kernel
    from engine.layouts import Bf16Linear, PackedLinear

    if layout == "packed" and not can_pack_linear_weights(torch.float32):
        pytest.skip("this torch cannot prepack float32 linears with oneDNN")
    if layout == "bf16-stored" and cpu_linear_kernel() is None:
        pytest.skip("the CPU linear kernel does not build here")
    monkeypatch.setattr(engine_module, "linear_layout", lambda device, dtype, fits_bf16: layout)
    doc, question = random_ids(123, 128, 1), random_ids(6, 128, 2)
    answers = []
    for stack in ("plain", levels):
        engine = tiny_engine(stack, dtype="float32", bf16_weights=layout == "bf16-stored")
        for model in (engine.target, engine.draft):
            if model is not None:
                kind = PackedLinear if layout == "packed" else Bf16Linear
                assert isinstance(model.model.layers[0].mlp.up_proj, kind) and isinstance(model.lm_head, kind)
        session = engine.open(doc)
        answers.append([t for e in session.ask(question, SamplingConfig(max_new_tokens=20)) for t in e.tokens])
    assert len(answers[0]) == 20 and answers[1] == answers[0]


def test_a_bf16_checkpoint_on_cpu_is_stored_bf16_and_others_are_not():
    """The engine picks "bf16-stored" per model: for weights that are bf16 values only."""
    from engine.device import can_pack_linear_weights, cpu_linear_kernel
    from engine.layouts import Bf16Linear, PackedLinear

    if cpu_linear_kernel() is None:
        pytest.skip("the CPU linear kernel does not build here")
    rounded = tiny_engine("draft>full", dtype="float32", bf16_weights=True)
    raw = tiny_engine("draft>full", dtype="float32")
    assert isinstance(rounded.target.lm_head, Bf16Linear) and isinstance(rounded.draft.lm_head, Bf16Linear)
    assert not isinstance(raw.target.lm_head, Bf16Linear)
    assert isinstance(raw.target.lm_head, PackedLinear) or not can_pack_linear_weights(torch.float32)
    assert rounded.dtype == raw.dtype == torch.float32


def test_a_check_cut_at_the_length_limit_keeps_the_retrieval_selection(monkeypatch):
    """The stack cuts a check's tokens at the length limit (or a stop token) before committing
    them, so the cut never rolls the middle level back (a re-selection the next question repeats)."""
    from engine.speculative import CheckingDrafter

    n_rebuilds, rebuild = [0], CheckingDrafter._rebuild
    monkeypatch.setattr(CheckingDrafter, "_rebuild", lambda self: (n_rebuilds.__setitem__(0, n_rebuilds[0] + 1),
                                                                   rebuild(self)))
    session = tiny_engine("retrieval>full", gamma_middle=4).open(random_ids(40, 128, 1))  # fits the budget
    n_rebuilds[0] = 0
    events = list(session.ask(random_ids(3, 128, 2), SamplingConfig(max_new_tokens=2)))
    assert len([t for e in events for t in e.tokens]) == 2 and events[-1].finish_reason == "length"
    assert events[-1].stats.levels[-1].n_emitted > 2  # the check emitted more than the answer keeps
    assert n_rebuilds[0] == 1  # the question's re-selection only


def test_truncating_only_tokens_the_middle_never_took_keeps_its_selection():
    """A rollback that removes only tokens whose KV the retrieval cache has not taken (at or past
    `synced`) drops the middle's scratch and keeps its chunks; one into taken tokens re-selects."""
    from engine.speculative import CheckingDrafter, GammaTuner, LevelStats

    calls = []
    middle = CheckingDrafter(None, None, LevelStats("retrieval"), GammaTuner(1, 4), synced_length=lambda: 5,
                             sync=lambda: calls.append("sync"), rebuild=lambda: calls.append("rebuild"),
                             rebuild_every_tokens=16, rebuild_below=0.4)
    middle.reset(list(range(8)))
    middle.truncate(7)  # tokens 0..6 stay: the cache took 0..4, so its selection stands
    middle.truncate(5)  # token 4 was taken: its KV must go, re-select
    assert calls == ["rebuild", "sync", "rebuild"] and middle.tokens == [0, 1, 2, 3, 4]


def test_the_stacks_own_time_per_token_leaves_out_the_callers(monkeypatch):
    """`step_ms_mean` counts the stack's steps only: a caller that takes a second per event (an app
    drawing each token) slows the wall-clock TBT, not the speedup's numerator. The clock is fake:
    each reading advances it 1 ms, the caller 1 s."""
    import engine.session

    clock = [0.0]

    def fake_now(device):
        clock[0] += 0.001
        return clock[0]

    monkeypatch.setattr(engine.session, "now", fake_now)
    session = tiny_engine("plain").open(random_ids(40, 128, 30))
    events = []
    for event in session.ask(random_ids(4, 128, 31), SamplingConfig(max_new_tokens=6)):
        clock[0] += 1.0
        events.append(event)
    stats = events[-1].stats
    assert stats.n_tokens == 6 and stats.step_ms_mean == pytest.approx(1.0)
    assert stats.tbt_ms_mean == pytest.approx(1002.0)  # the caller's second + two clock readings
    top = stats.levels[-1]
    assert top.n_checks == 6 and top.n_alone == 5  # plain's steps after the first are its baseline
    assert stats.plain_ms == pytest.approx(1000 * top.alone_s / 5) and stats.plain_ms > 0  # the real clock's


def test_the_threads_flag_means_the_same_in_every_entry_point():
    """app.py, `python -m tools` and `python -m api` share the engine's flags and `apply_threads`."""
    import argparse
    import importlib.util
    from pathlib import Path

    from api.__main__ import parse_args as api_args
    from tools.__main__ import parse_args as engine_args
    from tools.flags import add_engine_args, apply_threads

    p = argparse.ArgumentParser()
    add_engine_args(p)
    before = torch.get_num_threads()
    try:
        apply_threads(p.parse_args([]))  # 0: torch's default, untouched
        assert torch.get_num_threads() == before
        apply_threads(p.parse_args(["--threads", "1"]))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    spec = importlib.util.spec_from_file_location("app_main", Path(__file__).resolve().parents[2] / "app.py")
    app_entry = importlib.util.module_from_spec(spec)  # app.py (`import app` is the app/ package)
    spec.loader.exec_module(app_entry)
    generate = ["generate", "--file", "b.txt", "--question", "q"]
    for parse in (app_entry.parse_args, api_args, lambda argv: engine_args([*generate, *argv])):
        assert parse(["--threads", "3"]).threads == 3 and parse([]).threads == 0


def test_the_sampling_flags_are_the_sampling_fields_with_one_default_in_every_entry_point():
    """`python -m tools generate` and `python -m api` take a flag for each SamplingConfig field a
    reader sets, unset (the model's own) but the answer length, whose default is one constant."""
    from api.__main__ import parse_args as api_args
    from engine.config import ANSWER_TOKENS, SAMPLING_FIELDS, SamplingConfig
    from tools.__main__ import parse_args as engine_args
    from tools.flags import sampling_from_args

    assert set(SAMPLING_FIELDS) == {"temperature", "top_p", "top_k", "max_new_tokens", "seed", "min_p",
                                    "repetition_penalty", "presence_penalty", "frequency_penalty"}
    generate = ["generate", "--file", "b.txt", "--question", "q"]
    for parse in (api_args, lambda argv: engine_args([*generate, *argv])):
        unset = parse([])
        assert {name: getattr(unset, name) for name in SAMPLING_FIELDS} == {
            name: ANSWER_TOKENS if name == "max_new_tokens" else None for name in SAMPLING_FIELDS}
        model_own = SamplingConfig(temperature=0.7, top_p=0.8, top_k=20)
        given = sampling_from_args(parse(["--top-k", "5", "--min-p", "0.1", "--seed", "3"]), model_own)
        assert given == SamplingConfig(temperature=0.7, top_p=0.8, top_k=5, min_p=0.1, seed=3,
                                       max_new_tokens=ANSWER_TOKENS)
