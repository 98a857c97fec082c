"""Memory planner: hand-checked bytes for real model shapes at 128K tokens (no network)."""

import pytest
import torch

from engine.config import ModelConfig, OutOfMemoryPlan
from engine.memory import (
    GIB,
    DeviceBudget,
    MemoryPlan,
    Workload,
    activation_bytes,
    free_memory_bytes,
    max_tokens_that_fit,
    plan_memory,
    resident_kv_layers,
    weight_bytes,
)

MIB, KIB = 1 << 20, 1 << 10
N_128K = 131072


def llama2_7b() -> ModelConfig:  # meta-llama/Llama-2-7b-hf config.json
    return ModelConfig(n_layers=32, dim=4096, n_heads=32, n_kv_heads=32, head_dim=128,
                       intermediate=11008, vocab_size=32000, rms_eps=1e-5, has_qkv_bias=False,
                       has_tied_embeddings=False, max_positions=4096)


def llama31_8b() -> ModelConfig:  # meta-llama/Llama-3.1-8B config.json
    return ModelConfig(n_layers=32, dim=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                       intermediate=14336, vocab_size=128256, rms_eps=1e-5, has_qkv_bias=False,
                       has_tied_embeddings=False, max_positions=131072)


def qwen25_7b() -> ModelConfig:  # Qwen/Qwen2.5-7B config.json
    return ModelConfig(n_layers=28, dim=3584, n_heads=28, n_kv_heads=4, head_dim=128,
                       intermediate=18944, vocab_size=152064, rms_eps=1e-6, has_qkv_bias=True,
                       has_tied_embeddings=False, max_positions=131072)


def llama32_1b() -> ModelConfig:  # meta-llama/Llama-3.2-1B config.json (tied embeddings)
    return ModelConfig(n_layers=16, dim=2048, n_heads=32, n_kv_heads=8, head_dim=64,
                       intermediate=8192, vocab_size=128256, rms_eps=1e-5, has_qkv_bias=False,
                       has_tied_embeddings=True, max_positions=131072)


def qwen25_05b() -> ModelConfig:  # Qwen/Qwen2.5-0.5B config.json (also the packaged Coder 0.5B)
    return ModelConfig(n_layers=24, dim=896, n_heads=14, n_kv_heads=2, head_dim=64,
                       intermediate=4864, vocab_size=151936, rms_eps=1e-6, has_qkv_bias=True,
                       has_tied_embeddings=True, max_positions=32768)


def qwen25_15b() -> ModelConfig:  # Qwen/Qwen2.5-1.5B config.json (the packaged Coder 1.5B)
    return ModelConfig(n_layers=28, dim=1536, n_heads=12, n_kv_heads=2, head_dim=128,
                       intermediate=8960, vocab_size=151936, rms_eps=1e-6, has_qkv_bias=True,
                       has_tied_embeddings=True, max_positions=32768)


def rtx4090s(n: int, host_gib: int = 128) -> list[DeviceBudget]:
    gpus = [DeviceBudget(f"cuda:{i}", 24 * GIB, "cuda") for i in range(n)]
    return gpus + [DeviceBudget("cpu", host_gib * GIB, "cpu")]


@pytest.mark.parametrize("cfg, per_token_bytes, at_128k_bytes", [
    (llama2_7b(), 512 * KIB, 64 * GIB),  # 2 * 32 layers * 32 heads * 128 * 2 bytes
    (llama31_8b(), 128 * KIB, 16 * GIB),  # 2 * 32 * 8 * 128 * 2
    (qwen25_7b(), 56 * KIB, 7 * GIB),  # 2 * 28 * 4 * 128 * 2
])
def test_kv_bytes_per_token_match_published_shapes(cfg, per_token_bytes, at_128k_bytes):
    assert cfg.kv_bytes_per_token(2) == per_token_bytes
    assert N_128K * cfg.kv_bytes_per_token(2) == at_128k_bytes


@pytest.mark.parametrize("cfg, n_params", [
    (llama2_7b(), 6_738_415_616),  # the parameter counts Hugging Face reports for these models
    (llama31_8b(), 8_030_261_248),
    (qwen25_7b(), 7_615_616_512),
    (llama32_1b(), 1_235_814_400),
    (qwen25_05b(), 494_032_768),
    (qwen25_15b(), 1_543_714_304),
])
def test_weight_bytes_match_parameter_counts(cfg, n_params):
    assert weight_bytes(cfg, 2) == 2 * n_params


def test_activations_count_the_logits_rows_asked_for_and_the_tail_masks_sdpa_makes():
    # Llama-2-7B, chunk 512, one rank: 512 * (6 * 4096 + 3 * 11008) * 2 bytes of hidden/MLP,
    # the bool [512, 131072] mask, its copy per query head of a KV head (G = 1), SDPA's bf16
    # version of it and that padded (2 + 2 bytes), and the one row of logits prefill asks for:
    # bf16, its float32 copy and sampling's two float64 rows, 32000 * (2 + 4 + 16) bytes
    expected = 512 * (6 * 4096 + 3 * 11008) * 2 + 512 * N_128K * (1 + 1 + 4) + 32000 * 22
    assert activation_bytes(llama2_7b(), 512, N_128K, 2) == expected == 462_339_584
    # a check of 8 drafted tokens asks for 9 rows: never the chunk's 512 (issue 54 row 2)
    assert activation_bytes(llama2_7b(), 512, N_128K, 2, n_logit_rows=9) - expected == 8 * 32000 * 22
    # GQA, G = 4 (Llama-3.1-8B): 1 + 4 * 5 = 21 bytes per query and key, 1.31 GiB at 128K
    mask_bytes = activation_bytes(llama31_8b(), 512, N_128K, 2) - activation_bytes(llama31_8b(), 512, 0, 2)
    assert mask_bytes == 21 * 512 * N_128K


def test_one_4090_offloads_llama2_7b_at_128k_keeping_two_layers():
    plan = plan_memory(llama2_7b(), N_128K, rtx4090s(1))
    # usable 0.95 * 24 GiB = 22.80 GiB; weights 12.55 GiB + retrieval 1024 tokens * 0.5 MiB
    # + activations 0.49 GiB = 13.54 GiB; double buffer 2 * 2 GiB; 5.26 GiB left / 2 GiB = 2 layers
    assert plan.is_offloaded and plan.n_resident_kv_layers == 2
    gpu, host = plan.devices
    assert gpu.weights_bytes == 13_476_831_232
    assert gpu.retrieval_kv_bytes == 512 * MIB
    assert gpu.full_kv_bytes == 2 * 2 * GIB and gpu.kv_buffer_bytes == 2 * 2 * GIB
    assert host.name == "cpu" and host.full_kv_bytes == 32 * 2 * GIB  # every layer: the authoritative copy


def test_two_4090s_split_weights_and_kv_heads():
    plan = plan_memory(llama2_7b(), N_128K, rtx4090s(2))
    rank0, rank1, host = plan.devices
    # layer weights halved (6,476,267,520 bytes), embedding + lm_head replicated (524,296,192)
    assert rank0.weights_bytes == rank1.weights_bytes == 6_476_267_520 + 524_296_192
    assert rank0.retrieval_kv_bytes == 256 * MIB  # 16 of 32 KV heads per rank
    # a layer's KV shard is 1 GiB; 22.80 - 6.52 weights - 0.25 retrieval - 0.47 activations
    # - 2 buffers = 13.56 GiB -> 13 layers stay on each GPU; the host holds 32 layers * 2 ranks
    assert plan.n_resident_kv_layers == 13
    assert rank0.full_kv_bytes == 13 * GIB and host.full_kv_bytes == 32 * 2 * GIB


def test_gqa_models_fit_on_chip_on_two_4090s_but_not_one():
    assert not plan_memory(llama31_8b(), N_128K, rtx4090s(2)).is_offloaded  # 8.5 + 8 GiB per rank
    assert plan_memory(llama31_8b(), N_128K, rtx4090s(1)).is_offloaded  # 15 + 16 GiB
    # 14.2 + 7 GiB, but G = 7 makes SDPA's masks of a 512-token chunk 2.25 GiB: 22 of 28 layers stay
    assert plan_memory(qwen25_7b(), N_128K, rtx4090s(1)).n_resident_kv_layers == 22


def test_tensor_parallel_needs_divisible_kv_heads():
    with pytest.raises(ValueError, match="divide evenly"):
        plan_memory(qwen25_7b(), N_128K, rtx4090s(3))  # 4 KV heads, 3 ranks


def test_refusal_names_the_largest_length_that_fits():
    # no offloading: 22.80 GiB usable - 13.17 GiB fixed parts leaves room for
    # about (24,481,313,587 - 14,138,220,544) // 524,288 KV bytes per token, less the scratch of
    # a retrieval rebuild (at this length larger than a prefill chunk's masks) and the scoring
    # queries (32 layers x 32 heads x 16 x 128 x 2 bytes = 4 MiB, 8 tokens' KV): 19,525 tokens
    with pytest.raises(OutOfMemoryPlan, match="largest length that fits is 19,525 tokens"):
        plan_memory(llama2_7b(), N_128K, rtx4090s(1), Workload(offload_allowed=False))
    work = Workload(offload_allowed=False)
    assert max_tokens_that_fit(llama2_7b(), rtx4090s(1), work) == 19_525
    plan_memory(llama2_7b(), 19_525, rtx4090s(1), Workload(offload_allowed=False))


def test_refusal_when_the_host_cannot_hold_the_offloaded_kv():
    with pytest.raises(OutOfMemoryPlan, match="cpu needs 64.00 GiB"):
        plan_memory(llama2_7b(), N_128K, rtx4090s(1, host_gib=32))


def test_refusal_when_weights_alone_do_not_fit():
    small_gpu = [DeviceBudget("cuda:0", 8 * GIB, "cuda"), DeviceBudget("cpu", 64 * GIB, "cpu")]
    with pytest.raises(OutOfMemoryPlan, match="does not fit even without a document"):
        plan_memory(llama2_7b(), N_128K, small_gpu)


def test_cpu_only_keeps_everything_in_host_memory():
    host = [DeviceBudget("cpu", 80 * GIB, "cpu")]
    plan = plan_memory(llama2_7b(), N_128K // 2, host)
    assert not plan.is_offloaded and plan.devices[0].full_kv_bytes == 32 * GIB
    with pytest.raises(OutOfMemoryPlan):
        plan_memory(llama2_7b(), N_128K, host)  # 64 + 12.55 + 0.5 + 0.49 GiB > 0.95 * 80 GiB


def test_self_speculation_counts_only_the_streaming_cache():
    plan = plan_memory(llama2_7b(), 8192, rtx4090s(1), Workload(draft=llama2_7b(), draft_cache_tokens=516))
    assert plan.devices[0].drafter_weights_bytes == 0
    assert plan.devices[0].drafter_cache_bytes == 516 * 512 * KIB


def test_free_memory_of_cpu_is_positive():
    assert free_memory_bytes("cpu") > 0


def test_plan_is_a_memory_plan_on_chip():
    plan = plan_memory(qwen25_7b(), 4096, rtx4090s(1))
    assert isinstance(plan, MemoryPlan) and plan.n_resident_kv_layers == 28
    assert [d.name for d in plan.devices] == ["cuda:0"]


def test_resident_layers_are_planned_for_every_rank_and_the_host_together():
    # 4090s with their shard of Llama-2-7B loaded: the measured free memory plus those weights
    one = resident_kv_layers(llama2_7b(), N_128K, [24 * GIB], 128 * GIB, Workload())
    assert one == plan_memory(llama2_7b(), N_128K, rtx4090s(1)).n_resident_kv_layers == 2
    two = resident_kv_layers(llama2_7b(), N_128K, [24 * GIB, 24 * GIB], 128 * GIB, Workload())
    assert two == plan_memory(llama2_7b(), N_128K, rtx4090s(2)).n_resident_kv_layers
    # GPU 0 drives a display: both ranks keep what the fuller one can hold
    assert resident_kv_layers(llama2_7b(), N_128K, [22 * GIB, 24 * GIB], 128 * GIB, Workload()) < two
    # the host holds both ranks' halves: 64 GiB of KV does not fit in 60 GiB of RAM for two ranks
    with pytest.raises(OutOfMemoryPlan, match="cpu needs 64.00 GiB"):
        resident_kv_layers(llama2_7b(), N_128K, [24 * GIB, 24 * GIB], 60 * GIB, Workload())


def test_a_retrieval_rebuild_is_planned_in_slices():
    from engine.memory import rebuild_bytes

    # Llama-3.1-8B at 128K on one rank: an 8192-key slice in bf16 and float32 (8 KV heads x 128),
    # 8192 chunk means in float32, and [4 * 16, 8192] scores twice (logits, softmax) per KV head
    want = 8192 * 8 * 128 * 6 + 8192 * 8 * (128 + 2 * 4 * 16) * 4
    assert rebuild_bytes(llama31_8b(), N_128K, 2) == want < 128 * MIB  # a whole layer in float32: 512 MiB
    without = plan_memory(llama31_8b(), N_128K, rtx4090s(2), Workload(retrieval_budget_tokens=0))
    plan = plan_memory(llama31_8b(), N_128K, rtx4090s(2))
    assert plan.devices[0].activation_bytes >= rebuild_bytes(llama31_8b(), N_128K, 2, n_ranks=2)
    assert plan.devices[0].activation_bytes >= without.devices[0].activation_bytes


def test_flash_attn_prefill_plans_no_tail_masks():
    no_masks = activation_bytes(llama31_8b(), 8192, N_128K, 2, has_tail_masks=False)
    assert no_masks == activation_bytes(llama31_8b(), 8192, 0, 2)  # nothing grows with the length
    assert activation_bytes(llama31_8b(), 8192, N_128K, 2) - no_masks == 21 * 8192 * N_128K


def test_the_rebuild_is_planned_with_the_engines_retrieval_settings(monkeypatch):
    """Finer chunks and more scoring queries make a rebuild's scores larger: the plan counts the
    engine's own retrieval settings, not the defaults."""
    from engine import session as engine_module
    from engine.config import RetrievalConfig
    from engine.memory import rebuild_bytes
    from tests.conftest import tiny_engine

    fine = RetrievalConfig(chunk_tokens=4, n_score_queries=64)
    default = plan_memory(llama31_8b(), N_128K, rtx4090s(1), Workload(has_tail_masks=False))
    plan = plan_memory(llama31_8b(), N_128K, rtx4090s(1), Workload(retrieval=fine, has_tail_masks=False))
    assert rebuild_bytes(llama31_8b(), N_128K, 2, retrieval=fine) > default.devices[0].activation_bytes
    assert plan.devices[0].activation_bytes == rebuild_bytes(llama31_8b(), N_128K, 2, retrieval=fine)

    engine = tiny_engine("retrieval>full")
    planned = []
    monkeypatch.setattr(engine_module, "resident_kv_layers", lambda *args: planned.append(args[-1]) or 0)
    monkeypatch.setattr(engine_module, "free_memory_bytes", lambda device: 1 << 40)
    engine.device = torch.device("cuda")  # the planner runs for GPUs only; nothing touches one here
    engine._planned_resident_layers(1000)
    assert planned[0].retrieval == engine.config.retrieval != RetrievalConfig()


# The mission's setups (issue 54): one RTX 4090, the offloaded prefill of flash-attn's 8192-token
# chunks (session.OFFLOAD_PREFILL_CHUNK_TOKENS) or SDPA's 512 with their masks, 128K tokens.
FLASH_8K = dict(prefill_chunk_tokens=8192, has_tail_masks=False)


def test_llama31_8b_with_llama32_1b_offloads_on_one_4090_keeping_six_layers():
    # usable 22.80 GiB: weights 14.96 + 1B drafter 2.30 (+ its 532-token cache) + retrieval 0.12
    # + activations of an 8192-token chunk 0.94 (its 9 logits rows: 24 MiB) + 4 MiB of queries
    # = 18.34 GiB; double buffer 2 x 0.5 GiB; 3.46 GiB left / 0.5 GiB = 6 layers. Counting
    # 8192 x 128,256 float32 logits (3.9 GiB that prefill never makes) refused the pair outright.
    plan = plan_memory(llama31_8b(), N_128K, rtx4090s(1), Workload(draft=llama32_1b(), **FLASH_8K))
    assert plan.n_resident_kv_layers == 6
    gpu = plan.devices[0]
    # per token: residual, normed, q, k, v, attention out (2 x 4096 + 2 x (4096 + 1024)); gate, up, act x up
    assert gpu.activation_bytes == 8192 * (18432 + 3 * 14336) * 2 + 9 * 128256 * 22 == 1_032_027_648
    assert gpu.query_log_bytes == 32 * 32 * 16 * 128 * 2 and gpu.kv_buffer_bytes == GIB
    assert gpu.total_bytes <= gpu.usable_bytes
    sdpa = plan_memory(llama31_8b(), N_128K, rtx4090s(1), Workload(draft=llama32_1b()))
    assert sdpa.n_resident_kv_layers == 6


def test_qwen25_7b_with_its_05b_keeps_most_layers_on_one_4090():
    # 14.19 GiB weights + 0.93 drafter + 0.05 retrieval + 1.13 activations; 7 GiB of KV at 128K
    # (YaRN x4), 0.25 GiB a layer: 24 of 28 stay with flash-attn, 19 with SDPA's 512-token masks
    flash, sdpa = Workload(draft=qwen25_05b(), **FLASH_8K), Workload(draft=qwen25_05b())
    assert plan_memory(qwen25_7b(), N_128K, rtx4090s(1), flash).n_resident_kv_layers == 24
    assert plan_memory(qwen25_7b(), N_128K, rtx4090s(1), sdpa).n_resident_kv_layers == 19
    # a 32K book fits on chip either way
    assert not plan_memory(qwen25_7b(), 32768, rtx4090s(1), flash).is_offloaded


def test_the_packaged_pair_fits_on_a_24_gib_gpu_and_in_24_gib_of_ram_at_its_32k():
    gpu = plan_memory(qwen25_15b(), 32768, rtx4090s(1), Workload(draft=qwen25_05b(), **FLASH_8K))
    assert not gpu.is_offloaded and gpu.devices[0].total_bytes < 6 * GIB
    host = plan_memory(qwen25_15b(), 32768, [DeviceBudget("cpu", 24 * GIB, "cpu")], Workload(draft=qwen25_05b()))
    # 1.5B 2.88 GiB + 0.5B 0.92 + 32K of KV 0.88 GiB + a 512-token chunk's masks (G = 6)
    assert host.devices[0].full_kv_bytes == 32768 * 28 * 2 * 2 * 128 * 2
    assert host.devices[0].total_bytes < 6 * GIB
