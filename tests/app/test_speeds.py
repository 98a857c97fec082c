"""app/speeds.py: the prefill estimate a reader sees before a book is read."""

from app.speeds import Speeds, attention_share
from engine.config import ModelConfig

# Qwen2.5-Coder-1.5B's shapes
QWEN_1_5B = ModelConfig(n_layers=28, dim=1536, n_heads=12, n_kv_heads=2, head_dim=128, intermediate=8960,
                        vocab_size=151936, rms_eps=1e-6, has_qkv_bias=True, has_tied_embeddings=True,
                        max_positions=32768)


def test_the_attention_share_counts_multiply_adds_from_the_shapes():
    linears_per_layer = 1536 * (2 * 1536 + 2 * 256 + 3 * 8960)  # q, o; k, v; gate, up, down
    assert attention_share(QWEN_1_5B) == 2 * 12 * 128 / linears_per_layer  # about 6.6e-5


def test_a_long_book_is_estimated_from_a_short_one_as_it_was_measured():
    """benchmarks/RESULTS.md, 2026-11-27, the 1.5B on 2 cores of the AVX512-BF16 EPYC: 8,192 tokens
    in 79.5 s (103 tokens/s), 32,000 in 526 s, 111,831 (YaRN) in 3,937 s. From the 8K book alone
    the estimate is within 10% of both; linear scaling said 310 s and 1,085 s."""
    speeds = Speeds(None)
    speeds.record_prefill("qwen2.5-coder-1.5b", 8192, 79.5)
    share = attention_share(QWEN_1_5B)
    for n_tokens, measured_s in ((32000, 526.0), (111831, 3937.0)):
        assert abs(speeds.prefill_s("qwen2.5-coder-1.5b", n_tokens, share) / measured_s - 1) < 0.1
    assert speeds.prefill_s("qwen2.5-coder-1.5b", 111831) < 0.3 * 3937.0  # linear: far too short


def test_the_nearest_measured_length_is_scaled_and_a_model_never_measured_has_no_estimate(tmp_path):
    speeds = Speeds(tmp_path)
    speeds.record_prefill("m", 1000, 10.0)
    speeds.record_prefill("m", 30000, 600.0)
    assert speeds.prefill_s("m", 30000, 1e-4) == 600.0
    assert speeds.prefill_s("m", 2000, 0.0) == 20.0
    assert Speeds(tmp_path).prefill_s("m", 30000) == 600.0  # kept in the library folder
    assert speeds.prefill_s("other", 1000) is None


def test_the_time_left_is_timed_in_work_not_tokens():
    """At 8K of the 1.5B's 112K-token prefill, 79.5 s in: 66 minutes in all were measured (the
    8K-only estimate above), not the 18 a tokens/s rate would say."""
    from app.speeds import time_left

    share = attention_share(QWEN_1_5B)
    left = time_left(79.5, 8192, 111831, share)
    assert abs((79.5 + left) / 3937.0 - 1) < 0.1
    assert time_left(79.5, 8192, 111831, 0.0) == 79.5 * (111831 - 8192) / 8192
    assert time_left(10.0, 500, 500, share) == 0.0


def test_a_reading_taken_up_again_is_timed_from_where_it_went_on_and_estimated_as_the_rest():
    """A stopped reading of 112K tokens read on from 56K: the time left counts this run's work only
    (the first 56K took no time of it), and the estimate before it is what is left to read."""
    from types import SimpleNamespace

    from app.speeds import prefill_work, time_left
    from app.ui import App

    share = attention_share(QWEN_1_5B)
    per_work = 3937.0 / prefill_work(111831, share)  # one 112K reading's rate
    elapsed = per_work * (prefill_work(64000, share) - prefill_work(56000, share))  # 56K -> 64K
    want = per_work * (prefill_work(111831, share) - prefill_work(64000, share))
    assert abs(time_left(elapsed, 64000, 111831, share, start=56000) / want - 1) < 1e-9
    assert time_left(elapsed, 64000, 111831, share) < 0.2 * want  # as if 64K had taken that long

    speeds = Speeds(None)
    app = SimpleNamespace(backend=SimpleNamespace(name="m", attention_share=share), speeds=speeds,
                          _faster_model=lambda *args: None)
    assert App.prefill_estimate(app, 111831, 56000) == (" · 50% was read before, the rest reads on from there"
                                                        " · the first book measures how fast this machine reads")
    speeds.record_prefill("m", 111831, 3937.0)
    rest = 3937.0 - speeds.prefill_s("m", 56000, share)
    assert App.prefill_estimate(app, 111831, 56000).endswith(f"from there: about {round(rest / 60)} min left")
    assert App.prefill_estimate(app, 111831) == " · about 1 h 6 min to read here"
    read_on = Speeds(None)  # the last 55,831 tokens of that reading, timed alone: a whole reading of 3,937 s
    read_on.record_prefill("m", 111831, 3937.0 - speeds.prefill_s("m", 56000, share), share, start=56000)
    assert abs(read_on.prefill_s("m", 111831, share) - 3937.0) < 0.01


def test_a_reading_that_took_no_time_is_not_a_speed(tmp_path):
    """A remote backend's "reading" returns in milliseconds: 0.00 s once rounded, which the
    picker's 'tokens/s prefill' divided by (a ZeroDivisionError seen in a test)."""
    speeds = Speeds(tmp_path / "speeds.json")
    speeds.record_prefill("remote", 4096, 0.004)
    assert speeds.describe("remote") == "not measured here yet"
    speeds.data["old"] = {"prefill": [[4096, 0.0]], "decode": [[4096, 80.0]]}  # a file from before
    assert speeds.describe("old") == "80 ms/token (4,096 tokens)"
