"""Cost model: its arithmetic on hand-computed cases, and the TriForce table reproduction."""

import json
from dataclasses import replace

import pytest

from benchmarks import cost_model as cm
from engine.config import ModelConfig


def test_expected_accepted_tokens():
    assert cm.expected_accepted_tokens(0.0, 5) == 1.0  # always rejected: the correction only
    assert cm.expected_accepted_tokens(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert cm.expected_accepted_tokens(1.0, 4) == 5.0  # all accepted + bonus
    assert cm.expected_accepted_tokens(0.9, 16) == pytest.approx((1 - 0.9**17) / 0.1)


def test_two_level_tbt():
    # 2 proposals at 1 ms + a 10 ms check, emitting 1.75 tokens per block
    assert cm.two_level_tbt_ms(1.0, 10.0, 0.5, 2) == pytest.approx(12 / 1.75)


def test_three_level_tbt_composes_the_middle_cycle():
    # the middle needs 4 / (1 + 0.5) = 2.667 checks of (1 + 4) ms for 4 tokens, then a 100 ms
    # top check emits (1 - 0.9^5) / 0.1 = 4.0951 tokens
    expected = (4 / 1.5 * 5 + 100) / 4.0951
    assert cm.three_level_tbt_ms(1.0, 4.0, 100.0, 0.5, 0.9, 1, 4) == pytest.approx(expected)


def tiny_model() -> ModelConfig:
    # per layer: attention 4*(4+2*4) + 4*4 = 64, MLP 3*4*8 = 96, norms 8 -> 168 params = 336 bytes
    # lm_head 10*4*2 = 80 bytes; KV 2 * 2 heads * 2 dims * 2 bytes = 16 bytes per token and layer
    return ModelConfig(n_layers=2, dim=4, n_heads=2, n_kv_heads=2, head_dim=2, intermediate=8,
                       vocab_size=10, rms_eps=1e-5, has_qkv_bias=False,
                       has_tied_embeddings=False, max_positions=4096)


def toy_hardware(n_gpus: int = 1, layer_overhead_ms: float = 0.0,
                 allreduce_ms: float = 0.0) -> cm.Hardware:
    # 1 GB/s HBM, 0.1 GB/s PCIe, unlimited host bandwidth and FLOPs
    return cm.Hardware("toy", n_gpus, 1 << 30, 1e9, 1e8, 1e15, 1e30, layer_overhead_ms,
                       allreduce_ms)


def test_forward_on_chip_reads_weights_and_kv_over_hbm():
    ms = cm.forward_ms(toy_hardware(), tiny_model(), 1, 1000)
    # 2 layers * (336 + 16,000) bytes + 80 bytes of lm_head at 1 GB/s, plus sampling
    assert ms == pytest.approx(1e3 * (2 * 16336 + 80) / 1e9 + cm.SAMPLING_MS)


def test_forward_offloaded_waits_for_pcie_per_layer():
    ms = cm.forward_ms(toy_hardware(), tiny_model(), 1, 1000, n_resident_kv_layers=0)
    # each layer: max(16,336 B / 1 GB/s = 0.016 ms, 16,000 B / 0.1 GB/s = 0.16 ms)
    assert ms == pytest.approx(2 * 0.16 + 1e3 * 80 / 1e9 + cm.SAMPLING_MS)
    one_resident = cm.forward_ms(toy_hardware(), tiny_model(), 1, 1000, n_resident_kv_layers=1)
    assert one_resident == pytest.approx(0.16 + 1e3 * (16336 + 80) / 1e9 + cm.SAMPLING_MS)


def test_tensor_parallel_halves_layers_and_pays_two_allreduces_per_layer():
    hw = toy_hardware(n_gpus=2, layer_overhead_ms=0.1, allreduce_ms=0.5)
    ms = cm.forward_ms(hw, tiny_model(), 1, 1000)
    # per rank: 168 + 8,000 bytes per layer; lm_head replicated; 2 * (0.1 + 2 * 0.5) overhead
    assert ms == pytest.approx(1e3 * (2 * 8168 + 80) / 1e9 + 2 * 1.1 + cm.SAMPLING_MS)


def test_host_bandwidth_is_shared_by_the_gpus_copies():
    hw = replace(toy_hardware(n_gpus=2), host_bytes_per_s=1e8)
    assert hw.transfer_bytes_per_s == 5e7  # two GPUs copy at once: half the host each


def test_plain_stack_is_one_top_forward():
    setup = cm.Setup(toy_hardware(), tiny_model(), 1000)
    assert cm.stack_tbt_ms(setup, "plain", 1, 1) == cm.forward_ms(toy_hardware(), tiny_model(), 1,
                                                                  1000)


def test_best_gammas_is_no_worse_than_any_fixed_choice():
    setup = cm.planned_setup(cm.RTX4090_X2, cm.LLAMA2_7B, cm.TRIFORCE_TOKENS,
                             "draft>retrieval>full", cm.LLAMA_68M, 12288, cm.AcceptanceRates())
    _, _, best_ms = cm.best_gammas(setup, "draft>retrieval>full")
    assert best_ms <= cm.stack_tbt_ms(setup, "draft>retrieval>full", 1, 16)


def test_reproduces_published_triforce_table_within_stated_error():
    rows = {(r["label"], r["method"]): r for r in cm.reproduce_triforce()}
    for key, published_ms in [
        (("2x4090 Llama2-7B-128K", "triforce"), 108),
        (("2x4090 Llama2-7B-128K", "autoregressive"), 840),
        (("2x4090 LWM-Text-Chat-128K", "triforce"), 114),
        (("2x4090 Llama2-13B-128K", "triforce"), 226),
        (("2x4090 Llama2-13B-128K", "autoregressive"), 1794),
        (("1x4090 Llama2-7B-128K", "triforce"), 312),
    ]:
        assert rows[key]["published_ms"] == published_ms
    assert cm.STATED_ERROR == 0.25
    for row in rows.values():
        assert abs(row["relative_error"]) <= cm.STATED_ERROR, row


def test_autoregressive_rows_do_not_depend_on_acceptance():
    low = cm.reproduce_triforce(cm.AcceptanceRates(retrieval_full=0.5, draft_retrieval=0.1))
    for base, other in zip(cm.reproduce_triforce(), low, strict=True):
        if base["method"] == "autoregressive":
            assert base["predicted_ms"] == other["predicted_ms"]


def test_implied_acceptance_hits_the_published_number():
    row = cm.triforce_rows()[0]
    implied = cm.implied_acceptance(row)
    setup = replace(row.setup, rates=replace(row.setup.rates, retrieval_full=implied))
    assert replace(row, setup=setup).predicted_ms() == pytest.approx(row.published_ms, rel=1e-3)


def test_main_writes_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cm, "RESULTS_PATH", tmp_path / "cost_model.json")
    cm.main()
    saved = json.loads((tmp_path / "cost_model.json").read_text())
    assert "not measurements" in saved["note"]
    assert len(saved["predictions"]) == 5 * 7  # five setups, seven stacks
    assert "PREDICTIONS, NOT MEASUREMENTS" in capsys.readouterr().out


def test_engine_overheads_count_coin_broadcasts_and_rebuild_copies():
    hw = toy_hardware(n_gpus=2, allreduce_ms=0.05)
    setup = cm.Setup(hw, tiny_model(), 1000, n_resident_kv_layers=1,
                     rates=cm.AcceptanceRates(retrieval_full=0.5))
    # gamma 2: 5 broadcasts of (0.05 + 0.03) ms per check, 1.75 tokens per check; a rebuild copies
    # the offloaded layer's K of one rank (1000 tokens * 4 bytes) over PCIe and the resident one's over HBM
    shares = 5 * (0.05 + cm.SYNC_MS) / 1.75
    rebuild = 1e3 * (4000 / 1e8 + 4000 / 1e9) / 100
    assert cm.engine_overheads_ms(setup, 2, 100) == pytest.approx(shares + rebuild)


def test_engine_today_takes_the_retrieval_acceptance_as_an_input():
    x16, x8 = cm.engine_today(cm.RTX4090_X2, acceptances=(0.8,)), cm.engine_today(acceptances=(0.8, 0.9))
    assert [r["retrieval_acceptance_input"] for r in x8] == [0.95, 0.8, 0.9]
    assert x8[0]["predicted_tbt_ms"] > x16[0]["predicted_tbt_ms"]  # half the PCIe rate: slower
    ours = [r for r in x8 if r["config"].startswith("engine today")]
    assert all(r["gamma_middle"] <= 8 for r in ours) and ours[0]["predicted_tbt_ms"] > ours[1]["predicted_tbt_ms"]
