"""Memory planner: the bytes each part of the engine needs on each device, before prefill.

Pure arithmetic over `ModelConfig` shapes (docs/ALGORITHM.md section 8), per GPU rank (tensor
parallel: layer weights and KV heads split; embeddings, drafter and logits replicated) and on the
host. Nothing is allocated here; only `free_memory_bytes` asks a device. Assumes fused attention
(no [T, S] scores materialised) and a full cache allocated once.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, fields, replace

import psutil
import torch

from engine.config import EngineConfig, ModelConfig, OutOfMemoryPlan, RetrievalConfig, SamplingConfig
from engine.kv.retrieval import MEAN_SLICE_TOKENS

GIB = 1 << 30
RESERVE_FRACTION = 0.05  # of each device's free memory left unplanned: allocator fragmentation
N_KV_BUFFERS = 2  # offloaded layers stream through a double buffer (layer i+1 copies while i runs)


@dataclass(frozen=True)
class DeviceBudget:
    name: str  # "cuda:0", "cpu"
    free_bytes: int
    kind: str  # "cuda" (a tensor-parallel rank) or "cpu" (the host; the only device when no GPU)

    def __post_init__(self):
        if self.kind not in ("cuda", "cpu") or self.free_bytes < 0:
            raise ValueError(f"DeviceBudget {self.name}: kind must be 'cuda' or 'cpu' and "
                             f"free_bytes >= 0, got {self.kind!r} and {self.free_bytes}")


@dataclass(frozen=True)
class DevicePlan:
    name: str
    free_bytes: int
    weights_bytes: int = 0
    full_kv_bytes: int = 0  # resident layers on a GPU; every layer on the host when offloaded
    kv_buffer_bytes: int = 0  # double buffer the offloaded layers stream through
    retrieval_kv_bytes: int = 0
    drafter_weights_bytes: int = 0
    drafter_cache_bytes: int = 0
    activation_bytes: int = 0  # one prefill chunk (its masks, the logits asked for) or a retrieval rebuild
    query_log_bytes: int = 0  # the last queries of every layer, kept for retrieval scoring (model.QueryLog)

    @property
    def total_bytes(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self)[2:])  # every part after free_bytes

    @property
    def usable_bytes(self) -> int:
        return int(self.free_bytes * (1 - RESERVE_FRACTION))


@dataclass(frozen=True)
class MemoryPlan:
    n_layers: int
    n_resident_kv_layers: int  # layers whose full KV stays on the GPU (all of them when on chip)
    devices: tuple[DevicePlan, ...]  # the GPU ranks, then the host when it holds anything

    @property
    def is_offloaded(self) -> bool:
        return self.n_resident_kv_layers < self.n_layers


@dataclass(frozen=True)
class Workload:
    """What runs besides the target and its full cache; the defaults are the engine's."""

    dtype_bytes: int = 2
    draft: ModelConfig | None = None  # the small drafter, or the target for self-speculation (its cache only)
    retrieval_budget_tokens: int = RetrievalConfig.budget_tokens  # 0: no middle level
    retrieval: RetrievalConfig = RetrievalConfig()  # its chunks and scoring queries size a rebuild
    prefill_chunk_tokens: int = EngineConfig.prefill_chunk_tokens
    offload_allowed: bool = True
    # the drafter's StreamingLLM cache: sinks + window + the tokens of one answer
    draft_cache_tokens: int = (EngineConfig.streaming_sink_tokens + EngineConfig.streaming_window_tokens
                               + SamplingConfig.max_new_tokens)
    has_tail_masks: bool = True  # prefill builds [T, S] masks (SDPA); flash-attn's causal chains do not
    # logits rows a forward asks for: a prefill chunk one (its last token), a check its draft + 1
    n_logit_rows: int = EngineConfig.max_gamma + 1


def weight_bytes(cfg: ModelConfig, dtype_bytes: int, n_ranks: int = 1) -> int:
    """Weights on one of `n_ranks` tensor-parallel ranks: the decoder layers are split evenly;
    token embedding, final norm and lm_head (tied or not) are replicated."""
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attention = cfg.dim * (q_dim + 2 * kv_dim) + q_dim * cfg.dim
    bias = (q_dim + 2 * kv_dim) if cfg.has_qkv_bias else 0
    mlp = 3 * cfg.dim * cfg.intermediate  # gate_proj, up_proj, down_proj
    layer = attention + bias + mlp + 2 * cfg.dim  # + input and post-attention norms
    embedding = (1 if cfg.has_tied_embeddings else 2) * cfg.vocab_size * cfg.dim + cfg.dim
    return (cfg.n_layers * layer // n_ranks + embedding) * dtype_bytes


def activation_bytes(cfg: ModelConfig, chunk_tokens: int, n_tokens: int, dtype_bytes: int,
                     n_ranks: int = 1, has_tail_masks: bool = True, n_logit_rows: int = 1) -> int:
    """Upper bound of one prefill chunk's live tensors on one rank (their sum, not their peak), with
    logits only for the `n_logit_rows` a forward asks for (model.Segment `n_logits`)."""
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    hidden = 2 * cfg.dim + 2 * (q_dim + kv_dim) // n_ranks  # residual, normed, q, k, v, attn out
    mlp = 3 * cfg.intermediate // n_ranks  # gate, up, act(gate) * up
    # the tail mask on CUDA without flash-attn (engine/attention.py `sdpa_attention`): bool
    # [T, S], repeated to [G*T, S]; SDPA turns a bool mask into one of q's dtype and the
    # memory-efficient kernel pads that to a multiple of 16 keys: (1 + G * (1 + 2 * dtype)) T S
    G = cfg.n_heads // cfg.n_kv_heads
    mask = chunk_tokens * n_tokens * (1 + G * (1 + 2 * dtype_bytes)) if has_tail_masks else 0
    # [R, V]: lm_head's output, its float32 copy, and sampling's float64 distribution and residual
    logits = n_logit_rows * cfg.vocab_size * (dtype_bytes + 4 + 2 * 8)
    return chunk_tokens * (hidden + mlp) * dtype_bytes + mask + logits


def query_log_bytes(cfg: ModelConfig, n_queries: int, dtype_bytes: int, n_ranks: int = 1) -> int:
    """The scoring queries a session keeps on one rank: [B=1, H, M, D] per layer (copies, so no
    prefill chunk's queries stay alive behind them)."""
    return cfg.n_layers * (cfg.n_heads // n_ranks) * n_queries * cfg.head_dim * dtype_bytes


def rebuild_bytes(cfg: ModelConfig, n_tokens: int, dtype_bytes: int, n_ranks: int = 1,
                  retrieval: RetrievalConfig = RetrievalConfig()) -> int:
    """Scratch of one layer's retrieval rebuild on one rank (engine/kv/retrieval.py `score_chunks`):
    a slice of keys and its float32 copy, every chunk's float32 mean, and the [G*M, n] scores."""
    Hkv, D = cfg.n_kv_heads // n_ranks, cfg.head_dim
    n_chunks, G = n_tokens // retrieval.chunk_tokens, cfg.n_heads // cfg.n_kv_heads
    key_slice = MEAN_SLICE_TOKENS * Hkv * D * (dtype_bytes + 4)
    return key_slice + n_chunks * Hkv * (D + 2 * G * retrieval.n_score_queries) * 4  # scores and softmax


def _fixed_parts(target: ModelConfig, n_tokens: int, n_ranks: int, work: Workload) -> DevicePlan:
    """Everything on one rank except the full cache."""
    dtype_bytes, draft = work.dtype_bytes, work.draft
    has_own_weights = draft not in (None, target)  # self-speculation shares the target's weights
    prefill = activation_bytes(target, work.prefill_chunk_tokens, n_tokens, dtype_bytes, n_ranks,
                               work.has_tail_masks, work.n_logit_rows)
    rebuild = (rebuild_bytes(target, n_tokens, dtype_bytes, n_ranks, work.retrieval)
               if work.retrieval_budget_tokens else 0)  # no middle level, no rebuilds
    return DevicePlan(
        "", 0, weights_bytes=weight_bytes(target, dtype_bytes, n_ranks),
        retrieval_kv_bytes=work.retrieval_budget_tokens * target.kv_bytes_per_token(dtype_bytes) // n_ranks,
        drafter_weights_bytes=weight_bytes(draft, dtype_bytes) if has_own_weights else 0,
        drafter_cache_bytes=work.draft_cache_tokens * draft.kv_bytes_per_token(dtype_bytes) if draft else 0,
        activation_bytes=max(prefill, rebuild),  # a prefill chunk's, or (while decoding) a retrieval rebuild's
        query_log_bytes=query_log_bytes(target, work.retrieval.n_score_queries, dtype_bytes, n_ranks))


def _plan(target: ModelConfig, n_tokens: int, devices: list[DeviceBudget],
          work: Workload) -> MemoryPlan | str:
    """The plan, or why it does not fit (a sentence naming the device and the bytes)."""
    gpus, hosts = [d for d in devices if d.kind == "cuda"], [d for d in devices if d.kind == "cpu"]
    assert devices and len(hosts) <= 1, f"give GPUs and at most one host ('cpu'), got {devices}"
    n_ranks, n_layers = max(1, len(gpus)), target.n_layers
    target.check_shardable(n_ranks)
    kv_token = target.kv_bytes_per_token(work.dtype_bytes) // n_ranks  # one rank
    layer_kv = n_tokens * kv_token // n_layers  # one layer of one rank's full cache
    fixed = _fixed_parts(target, n_tokens, n_ranks, work)
    on_chip = [replace(fixed, name=d.name, free_bytes=d.free_bytes, full_kv_bytes=n_layers * layer_kv)
               for d in gpus or hosts]  # CPU only: everything in host memory, nothing to offload
    why = [_fits(p) for p in on_chip if _fits(p)]
    if not why:
        return MemoryPlan(n_layers, n_layers, tuple(on_chip))
    if not gpus or not work.offload_allowed or not hosts:
        return why[0] + ("" if not gpus else " (offloading is off)" if not work.offload_allowed
                         else " (no host memory was given for offloading)")
    buffers = N_KV_BUFFERS * layer_kv
    room = min(p.usable_bytes for p in on_chip) - fixed.total_bytes - buffers
    n_resident = min(n_layers - 1, room // max(layer_kv, 1))
    plans = [replace(p, full_kv_bytes=max(n_resident, 0) * layer_kv, kv_buffer_bytes=buffers) for p in on_chip]
    if n_resident < 0:
        return next(_fits(p) for p in plans if _fits(p)) + " (even with the KV offloaded)"
    # the host holds every layer of every rank (engine/kv/offload.py): the resident layers too,
    # as the authoritative copy that snapshots and the retrieval cache read
    host = DevicePlan(hosts[0].name, hosts[0].free_bytes, full_kv_bytes=n_layers * layer_kv * n_ranks)
    return _fits(host) or MemoryPlan(n_layers, n_resident, tuple(plans) + (host,))


def _fits(plan: DevicePlan) -> str:
    """'' when `plan` fits its device's usable memory, else why not."""
    return "" if plan.total_bytes <= plan.usable_bytes else (
        f"{plan.name} needs {plan.total_bytes / GIB:.2f} GiB but has {plan.usable_bytes / GIB:.2f}"
        f" GiB usable ({plan.free_bytes / GIB:.2f} GiB free less {RESERVE_FRACTION:.0%} reserve)")


def plan_memory(target: ModelConfig, n_tokens: int, devices: list[DeviceBudget],
                work: Workload = Workload()) -> MemoryPlan:
    """Where each part lives for a document of `n_tokens`, with `work` beside the target; raises
    `OutOfMemoryPlan` if nowhere. `devices`: the GPUs (tensor-parallel ranks) and at most one host
    ("cpu"); CPU only when no GPU is given."""
    plan = _plan(target, n_tokens, devices, work)
    if isinstance(plan, MemoryPlan):
        return plan
    fit = max_tokens_that_fit(target, devices, work, limit=n_tokens)
    advice = (f"The largest length that fits is {fit:,} tokens: shorten the document to that, or "
              "use a smaller model, fewer retrieval tokens, offloading or another GPU."
              if fit else "The model does not fit even without a document: use a smaller model.")
    raise OutOfMemoryPlan(f"Not enough memory for {n_tokens:,} tokens: {plan}. {advice}")


def max_tokens_that_fit(target: ModelConfig, devices: list[DeviceBudget],
                        work: Workload = Workload(), limit: int = 1 << 40) -> int:
    """Largest length up to `limit` that `plan_memory` accepts (0: none); 2**40 exceeds any RAM."""
    # memory grows with the length, so the lengths that fit are a prefix of 1..limit: bisect it
    return bisect.bisect_left(range(1, limit + 1), True,
                              key=lambda n_tokens: not isinstance(_plan(target, n_tokens, devices, work), MemoryPlan))


def free_memory_bytes(device: str | torch.device) -> int:
    """Bytes free now: available RAM for 'cpu', `mem_get_info` for a CUDA device."""
    device = torch.device(device)
    if device.type == "cpu":
        return psutil.virtual_memory().available
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.mem_get_info(device)[0]  # (free, total)
    raise ValueError(f"cannot measure free memory on {device}: no such device here")


def resident_kv_layers(target: ModelConfig, n_tokens: int, gpu_free_bytes: list[int], host_free_bytes: int,
                       work: Workload) -> int:
    """Layers of an offloaded full cache that stay on each GPU for `n_tokens`: `target` whole (not one
    rank's shard), `gpu_free_bytes` each rank's free memory plus the weights it holds already."""
    devices = [DeviceBudget(f"cuda:{i}", free, "cuda") for i, free in enumerate(gpu_free_bytes)]
    devices.append(DeviceBudget("cpu", host_free_bytes, "cpu"))
    return plan_memory(target, n_tokens, devices, work).n_resident_kv_layers
