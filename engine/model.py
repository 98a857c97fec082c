"""One lean decoder forward for the Llama and Qwen2 families, over a pluggable KV cache.

Submodules keep Hugging Face's names, so HF weights load 1:1 with `load_state_dict`; RoPE
(default, llama3, yarn, linear, dynamic) is transformers' own rotary module (applied in one
call of our CPU kernel in a float32 or bf16 model there, bit for bit the same). The forward knows
nothing of speculation, offloading or tensor parallelism: it takes token ids, their absolute
positions and a cache (engine/kv), and returns logits. Token trees are verified by passing the
tail mask (engine/attention.py). `QueryLog` records recent queries for retrieval scoring.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import (
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    rotate_half,
)

from engine.attention import KERNEL_DTYPES, cpu_attention, cpu_kernel, is_tree_mask, masked_attention, sdpa_attention
from engine.config import ModelConfig
from engine.kv import KVCache

R = TypeVar("R")


class QueryLog:
    """The last `n_queries` post-RoPE queries of every layer (for scoring retrieval chunks)."""

    def __init__(self, n_layers: int, n_queries: int):
        self.n_queries = n_queries
        self.queries: list[torch.Tensor | None] = [None] * n_layers  # each [B, H, <=M, D]

    def record(self, layer_idx: int, q: torch.Tensor) -> None:
        old = self.queries[layer_idx]
        q = q if old is None else torch.cat([old, q], dim=2)
        self.queries[layer_idx] = q[:, :, -self.n_queries:].detach().clone()  # a view keeps the whole chunk


@dataclass
class Segment:
    """One sequence's part of a (packed) forward: its tokens, their positions, its cache."""

    ids: torch.Tensor  # [B, T]
    pos: torch.Tensor  # [T] absolute positions (RoPE)
    cache: KVCache
    tail: torch.Tensor | None = None  # [T, T] bool; None = causal chain
    query_log: QueryLog | None = None
    n_logits: int = 1  # logits of the last n tokens
    key_mask: torch.Tensor | None = None  # [T, S_max] bool: a static-shape step (engine/graphs.py)
    # whether `tail` is a token tree (not causal): pass it where the tail is built on the host, so
    # the kernels never look at the mask (flash-attn takes chains only)
    is_tree: bool | None = None

    def __post_init__(self):
        if self.is_tree is None:
            self.is_tree = self.tail is not None and is_tree_mask(self.tail)


@dataclass
class Forward:
    """A request for one segment of a forward. Decoding code is written as generators that
    yield these and receive the segment's logits ([B, n_logits, V]); `drive` serves them one at
    a time, engine/batch.py packs the requests of many sessions into one forward per model."""

    model: Transformer
    segment: Segment


Steps = Generator[Forward, torch.Tensor, R]  # a computation that asks for forwards and returns R


def forward_alone(request: Forward) -> torch.Tensor:
    """Serve one request by itself: its segment's logits [B, n_logits, V]."""
    return request.model.forward_packed([request.segment])[0]


def drive(steps: Generator, serve: Callable[[Forward], torch.Tensor] = forward_alone) -> Generator:
    """The one loop over a generator of forward requests (`Steps`, or an answer's steps, which
    yield events too): each `Forward` is answered with `serve(request)`, every other item is
    passed on; returns the steps' value. `serve` is a local forward (`forward_alone`); a batch
    round packs the forwards of many answers itself (engine/batch.py)."""
    result = None
    while True:
        try:
            item = steps.send(result)
        except StopIteration as stop:
            return stop.value
        if isinstance(item, Forward):
            result = serve(item)
        else:
            result = None
            yield item


def run(steps: Steps[R]) -> R:
    """`drive` steps that yield only forwards, here; return their value."""
    try:
        next(drive(steps))
    except StopIteration as stop:
        return stop.value
    raise AssertionError("run() drives steps that yield forwards only")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel = None  # engine/csrc/attention_cpu.cpp, for a float32 or bf16 model on CPU (set_attention)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:  # one call for torch's 6 ops (~3 vs 35-70 us a row)
            return self.kernel.rms_norm(x.contiguous(), self.weight, self.eps)
        # in float32 whatever x is (as HF: float64 models too), cast back, then the weight; torch's
        # rms_norm is bitwise equal to the pow/mean/rsqrt chain on torch 2.13, in fewer passes
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        bias = cfg.has_qkv_bias
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.attend = sdpa_attention  # replaced once by Transformer.set_attention
        self.kernel = None  # engine/csrc/attention_cpu.cpp's RoPE, for a float32 or bf16 model on CPU (set_attention)

    def forward(self, x, cos, sin, segments: list[Segment], bounds: list[int], layer_idx: int):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, D]
        if self.kernel is not None:  # in place, bit for bit apply_rotary_pos_emb's
            q, k = q.contiguous(), k.contiguous()
            self.kernel.rope_(q, k, cos.contiguous(), sin.contiguous())
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, D]
        else:
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        outs = []  # each segment attends over its own cache: [B, H, T_i, D]
        for seg, a, b in zip(segments, bounds, bounds[1:]):
            if seg.query_log is not None:
                seg.query_log.record(layer_idx, q[:, :, a:b])
            k_all, v_all = seg.cache.update(layer_idx, k[:, :, a:b], v[:, :, a:b])  # this call's keys last
            outs.append(self.attend(q[:, :, a:b], k_all, v_all, seg.tail, seg.is_tree) if seg.key_mask is None
                        else masked_attention(q[:, :, a:b], k_all, v_all, seg.key_mask))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.rms_eps)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.rms_eps)

    def forward(self, x, cos, sin, segments, bounds, layer_idx):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, segments, bounds, layer_idx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, hf_config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.rms_eps)
        self.rotary_emb = LlamaRotaryEmbedding(config=hf_config)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, hf_config):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg, hf_config)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.has_tied_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        """Of activations, caches and logits; linear weights may be stored narrower (engine/layouts.py)."""
        return self.model.norm.weight.dtype

    def set_attention(self, attend) -> None:
        """`attend` in every layer; with our CPU kernel, a float32 or bf16 model's norms and RoPE
        take its kernels too, on every path alike (a row's output is the same in any call)."""
        for layer in self.model.layers:
            layer.self_attn.attend = attend
        kernel = cpu_kernel() if attend is cpu_attention and self.dtype in KERNEL_DTYPES else None
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = kernel if module.weight.shape[0] % 32 == 0 else None
            elif isinstance(module, Attention):
                module.kernel = kernel if module.head_dim % 16 == 0 else None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        pos: torch.Tensor,  # [T] absolute positions (RoPE), increasing along a chain
        cache: KVCache,
        tail: torch.Tensor | None = None,  # [T, T] bool; None = causal chain
        query_log: QueryLog | None = None,
        n_logits: int | None = None,  # logits of the last n tokens only (prefill: 1)
    ) -> torch.Tensor:  # [B, T or n_logits, V] logits, float32 or wider
        seg = Segment(input_ids, pos, cache, tail, query_log, n_logits or input_ids.shape[1])
        return self.forward_packed([seg])[0]

    @torch.inference_mode()
    def forward_packed(self, segments: list[Segment]) -> list[torch.Tensor]:
        """Several sequences in one forward: their tokens are concatenated along T, so every
        weight is read once for all of them, and each attends over its own cache (MagicDec-style
        batching of sessions at different lengths). Returns each segment's [B, n_logits, V]."""
        ids = torch.cat([s.ids for s in segments], dim=1)  # [B, sum T]
        B, T = ids.shape
        bounds = [0]
        for s in segments:
            bounds.append(bounds[-1] + s.ids.shape[1])
            if s.tail is None and s.ids.shape[1] > 1:
                s.tail = torch.ones(s.ids.shape[1], s.ids.shape[1], dtype=torch.bool, device=ids.device).tril()
        x = self.model.embed_tokens(ids).to(self.dtype)  # [B, T, dim]; a bf16-stored table widens
        pos = torch.cat([s.pos for s in segments])
        cos, sin = self.model.rotary_emb(x, pos.expand(B, T))
        for layer_idx, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, segments, bounds, layer_idx)
        rows = []
        for s, end in zip(segments, bounds[1:]):
            s.cache.advance(s.ids.shape[1])
            rows.append(torch.arange(end - s.n_logits, end, device=ids.device))
        rows = torch.cat(rows)
        logits = self.lm_head(self.model.norm(x[:, rows] if rows.shape[0] < T else x))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        return list(logits.split([s.n_logits for s in segments], dim=1))

    def rotate(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Rotate post-RoPE keys ([..., n, D]) by `delta` positions (pure rotation, no scaling)."""
        rotary = self.model.rotary_emb
        cos, sin = rotary(k, torch.full((1, 1), delta, device=k.device))  # [1, 1, D]
        scale = rotary.attention_scaling
        return k * (cos[0] / scale) + rotate_half(k) * (sin[0] / scale)
