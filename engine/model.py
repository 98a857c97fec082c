"""One lean decoder forward for the Llama, Mistral, Qwen2/3, Gemma 2/3 and Phi-3 families over a
pluggable KV cache; a few `ModelConfig` switches say what a family adds (q/k norms, Gemma's norms
and scales, soft-capping, sliding-window layers); engine/families.py refuses the rest.

Submodules keep Hugging Face's names, so weights load 1:1; RoPE is transformers' own rotary module.
The forward knows nothing of speculation, offloading or tensor parallelism: token ids, absolute
positions and a cache (engine/kv) in, logits out; engine/README.md, "The request protocol", says who asks.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb, rotate_half

from engine.attention import (
    KERNEL_DTYPES,
    cpu_attention,
    cpu_kernel,
    masked_attention,
    sdpa_attention,
    tail_mask,
)
from engine.config import ModelConfig
from engine.kv import KVCache

R = TypeVar("R")
ROW_BY_ROW = 16  # chain checks up to this many tokens on a windowed or soft-capped layer go row by row


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
    query_log: QueryLog | None = None
    n_logits: int = 1  # logits of the last n tokens
    key_mask: torch.Tensor | None = None  # [T, S_max] bool: a static-shape step (engine/graphs.py)
    window: tuple[int, torch.Tensor | None] | None = None  # a sliding layer's view: `sliding_window_keys`
    tail: torch.Tensor | None = field(default=None, init=False)  # [T, T] causal (every call is a chain); T == 1: None

    def __post_init__(self):
        T = self.ids.shape[1]
        if T > 1:
            self.tail = torch.ones(T, T, dtype=torch.bool, device=self.ids.device).tril()


@dataclass
class Forward:
    """A request for one segment of a forward; the generator that yields it receives [B, n_logits, V]."""

    model: Transformer
    segment: Segment


Steps = Generator[Forward, torch.Tensor, R]  # a computation that asks for forwards and returns R


def drive(steps: Generator) -> Generator:
    """Serve `Steps` one forward at a time, passing an answer's events on; returns their value."""
    result = None
    while True:
        try:
            item = steps.send(result)
        except StopIteration as stop:
            return stop.value
        if isinstance(item, Forward):
            result = item.model.forward_packed([item.segment])[0]
        else:
            result = None
            yield item


def sliding_window_keys(seg: Segment, window: int) -> tuple[int, torch.Tensor | None] | None:
    """What a sliding layer's queries see of `seg`'s view, where key i is the token at position i
    (`keys_at_positions`; others are read whole): (first key read, [T, S'] mask over the keys from
    there, or None when none is hidden), or None for the whole view. A key at position j is visible
    from position p when p - window < j <= p (transformers' rule). One host read per forward."""
    if not getattr(seg.cache, "keys_at_positions", False):
        return None
    pos = seg.pos  # [T]
    if seg.key_mask is not None:  # a static-shape step's view is the whole capacity, slot i at position i
        slots = torch.arange(seg.key_mask.shape[1], device=pos.device)
        return 0, seg.key_mask & (slots[None, :] > pos[:, None] - window)
    T = pos.shape[0]
    first, last = map(int, pos.aminmax())
    if last < window:
        return None
    start = max(0, first - window + 1)
    if T == 1:
        return start, None
    key_pos = torch.cat([torch.arange(start, seg.cache.length, device=pos.device), pos])  # [S']
    visible = key_pos[None, :] > pos[:, None] - window  # [T, S']
    visible[:, -T:] &= seg.tail
    return start, visible


def run(steps: Steps[R]) -> R:
    """`drive` steps that yield only forwards, here; return their value."""
    try:
        next(drive(steps))
    except StopIteration as stop:
        return stop.value
    raise AssertionError("run() drives steps that yield forwards only")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, is_offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.is_offset = is_offset  # Gemma: scaled by 1 + w, in float32, then cast (as HF's Gemma norms)
        self.kernel = None  # engine/csrc/attention_cpu.cpp, for a float32 or bf16 model on CPU (set_attention)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:  # one call for torch's 6 ops, each with its own overhead
            return self.kernel.rms_norm(x.contiguous(), self.weight, self.eps)
        if self.is_offset:
            return (F.rms_norm(x.float(), self.weight.shape, eps=self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        # in float32 whatever x is (as HF: float64 too), cast back, then the weight; F.rms_norm is HF's chain bitwise
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, is_sliding: bool = False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.has_qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.has_qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.has_qkv_bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        if cfg.has_qk_norm:  # over each head's D values, before RoPE
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, cfg.is_gemma)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_eps, cfg.is_gemma)
        self.window = cfg.sliding_window if is_sliding else None
        self.softcap = cfg.attn_softcap
        self.scale = cfg.query_scale or cfg.head_dim ** -0.5
        # SDPA and the kernels scale by head_dim ** -0.5: a Gemma query is pre-scaled to its own scale
        # (exactly 1 otherwise: head_dim ** -0.5 * head_dim ** 0.5 is 1 + 2e-16 for 128, one more op a layer)
        self.q_factor = 1.0 if cfg.query_scale is None else self.scale * cfg.head_dim ** 0.5
        self.attend = sdpa_attention  # replaced once by Transformer.set_attention
        self.kernel = None  # engine/csrc/attention_cpu.cpp's RoPE, for a float32 or bf16 model on CPU (set_attention)

    def forward(self, x, cos, sin, segments: list[Segment], bounds: list[int], layer_idx: int):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
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
            outs.append(self._attend(q[:, :, a:b], k_all, v_all, seg))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))

    def _attend(self, q, k, v, seg: Segment):  # q [B, H, T, D], k and v [B, Hkv, S, D] -> [B, H, T, D]
        """The configured kernel over the view, unless a sliding layer's window hides keys of it
        (`Segment.window`: the keys sliced, a mask over the rest) or the scores are soft-capped.
        A chain check on those paths runs row by row over each row's own keys: every row is then
        what decoding its token alone computes, bit for bit (as the kernel's rows are)."""
        mask, T = seg.key_mask, q.shape[2]
        is_windowed = self.window is not None and seg.window is not None
        if is_windowed:
            start, mask = seg.window
            k, v = k[:, :, start:], v[:, :, start:]
        if (self.softcap or mask is not None) and 1 < T <= ROW_BY_ROW and seg.key_mask is None:
            rows = []
            for t in range(T):
                end = k.shape[2] - T + t + 1  # this row's own key is the last it sees
                first = max(0, end - self.window) if is_windowed else 0  # keys before `start` are in no row's window
                rows.append(self._attend_keys(q[:, :, t:t + 1], k[:, :, first:end], v[:, :, first:end], None, None))
            return torch.cat(rows, dim=2)
        return self._attend_keys(q, k, v, mask, seg.tail if T > 1 else None)

    def _attend_keys(self, q, k, v, mask, tail):
        if self.softcap:
            mask = tail_mask(k.shape[2], tail) if mask is None and tail is not None else mask
            return masked_attention(q, k, v, mask, self.scale, self.softcap)
        q = q if self.q_factor == 1 else q * self.q_factor
        if mask is not None:
            return masked_attention(q, k, v, mask)
        return self.attend(q, k, v, tail)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.dim, cfg.intermediate, bias=False)
        self.up_proj = nn.Linear(cfg.dim, cfg.intermediate, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate, cfg.dim, bias=False)
        self.is_gelu = cfg.is_gemma  # GeGLU with tanh GELU; SwiGLU otherwise

    def forward(self, x):
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.is_gelu else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0):
        super().__init__()
        self.self_attn = Attention(cfg, bool(cfg.sliding_layers) and cfg.sliding_layers[layer_idx])
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.dim, cfg.rms_eps, cfg.is_gemma)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.rms_eps, cfg.is_gemma)
        self.is_gemma = cfg.is_gemma
        if cfg.is_gemma:  # Gemma: post_attention_layernorm normalizes the attention's output, these the MLP's
            self.pre_feedforward_layernorm = RMSNorm(cfg.dim, cfg.rms_eps, True)
            self.post_feedforward_layernorm = RMSNorm(cfg.dim, cfg.rms_eps, True)

    def forward(self, x, cos, sin, segments, bounds, layer_idx):
        h = self.self_attn(self.input_layernorm(x), cos, sin, segments, bounds, layer_idx)
        if self.is_gemma:
            x = x + self.post_attention_layernorm(h)
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


def rotary_embedding(hf_config) -> nn.Module:
    """transformers' own rotary module for the config: Gemma 3's (a RoPE base per layer type) or Llama's."""
    if hf_config.model_type == "gemma3_text":
        return Gemma3RotaryEmbedding(config=hf_config)
    rotary = LlamaRotaryEmbedding(config=hf_config)
    if rotary.rope_type == "longrope":  # Phi-3's long factors at every position, as llama.cpp's for a long
        # context; transformers picks them per call (by its last position): a key would depend on the chunking
        original = hf_config.rope_parameters["original_max_position_embeddings"]
        long_inv_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf_config, rotary.inv_freq.device, seq_len=original + 1)
        rotary.original_inv_freq = long_inv_freq
        rotary.inv_freq.copy_(long_inv_freq)
    return rotary


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, hf_config):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg, layer_idx) for layer_idx in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.rms_eps, cfg.is_gemma)
        self.rotary_emb = rotary_embedding(hf_config)


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
        kernel = cpu_kernel() if attend is cpu_attention and self.dtype in KERNEL_DTYPES else None
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.kernel = kernel if module.weight.shape[0] % 32 == 0 and not module.is_offset else None
            elif isinstance(module, Attention):
                module.attend = attend
                module.kernel = kernel if module.head_dim % 16 == 0 else None

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        pos: torch.Tensor,  # [T] absolute positions (RoPE), increasing along a chain
        cache: KVCache,
        query_log: QueryLog | None = None,
        n_logits: int | None = None,  # logits of the last n tokens only (prefill: 1)
    ) -> torch.Tensor:  # [B, T or n_logits, V] logits, float32 or wider
        seg = Segment(input_ids, pos, cache, query_log, n_logits or input_ids.shape[1])
        return self.forward_packed([seg])[0]

    @torch.inference_mode()
    def forward_packed(self, segments: list[Segment]) -> list[torch.Tensor]:
        """Several sequences in one forward, their tokens concatenated along T (the weights are read
        once), each attending over its own cache. Returns each segment's [B, n_logits, V]."""
        ids = torch.cat([s.ids for s in segments], dim=1)  # [B, sum T]
        B, T = ids.shape
        bounds = [0, *itertools.accumulate(s.ids.shape[1] for s in segments)]
        x = self.model.embed_tokens(ids).to(self.dtype)  # [B, T, dim]; a bf16-stored table widens
        if self.config.is_gemma:  # sqrt(dim) rounded to the model's dtype, as HF's Gemma
            x = x * torch.tensor(self.config.dim ** 0.5, dtype=x.dtype)
        for s in segments if self.config.sliding_window else ():
            s.window = sliding_window_keys(s, self.config.sliding_window)
        pos = torch.cat([s.pos for s in segments])
        ropes = self.rope_tables(x, pos.expand(B, T))
        for layer_idx, layer in enumerate(self.model.layers):
            x = layer(x, *ropes[layer_idx], segments, bounds, layer_idx)
        for s in segments:
            s.cache.advance(s.ids.shape[1])
        rows = torch.cat([torch.arange(end - s.n_logits, end, device=ids.device)
                          for s, end in zip(segments, bounds[1:])])
        logits = self.lm_head(self.model.norm(x[:, rows] if rows.shape[0] < T else x))
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if self.config.final_softcap:  # Gemma 2
            logits = torch.tanh(logits / self.config.final_softcap) * self.config.final_softcap
        return list(logits.split([s.n_logits for s in segments], dim=1))

    def rope_tables(self, x: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) of each layer at positions `pos` ([B, T]), each [B, T, D]: one table for
        every layer, or Gemma 3's two (sliding layers rotate with their own base)."""
        rotary = self.model.rotary_emb
        if not self.config.has_local_rope:
            return [rotary(x, pos)] * self.config.n_layers
        tables = {kind: rotary(x, pos, kind) for kind in rotary.layer_types}  # the kinds the layers have
        return [tables["sliding_attention" if s else "full_attention"] for s in self.config.sliding_layers]

    def rotate(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """Rotate post-RoPE keys ([L, ..., n, D], every layer's) by `delta` positions (pure
        rotation, no scaling); a model with one RoPE table takes any leading shape."""
        rotary = self.model.rotary_emb
        tables = self.rope_tables(k, torch.full((1, 1), delta, device=k.device))  # each [1, 1, D]
        if not self.config.has_local_rope:
            return _rotated(k, *tables[0], rotary.attention_scaling)
        kinds = ["sliding_attention" if s else "full_attention" for s in self.config.sliding_layers]
        return torch.stack([_rotated(k[i], cos, sin, getattr(rotary, f"{kind}_attention_scaling"))
                            for i, ((cos, sin), kind) in enumerate(zip(tables, kinds))])


def _rotated(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scale: float) -> torch.Tensor:
    """k rotated by the RoPE table (cos, sin) ([1, 1, D]) that `scale` multiplied."""
    return k * (cos[0] / scale) + rotate_half(k) * (sin[0] / scale)
