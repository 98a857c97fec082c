"""Configuration dataclasses: model shapes, engine settings, sampling settings, typed errors.

Plain data. Model shapes come from the Hugging Face config in one place (`ModelConfig.from_hf`);
defaults work offline on a 2-core CPU. `LEVEL_STACKS` lists the stacks of docs/ALGORITHM.md section 2 we run.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

LEVEL_STACKS = (
    "plain",
    "ngram>full",
    "draft>full",
    "retrieval>full",
    "ngram>retrieval>full",
    "draft>retrieval>full",
    "ngram+draft>full",
    "ngram+draft>retrieval>full",
    "selfspec>full",
)
PAIRED_DRAFTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}  # draft="auto": a packaged target's small sibling
# levels="auto", by whether there is a draft: the fastest stack measured (benchmarks/RESULTS.md). On a
# CPU the draft's proposals cost more than they save; it is loaded when a session first asks for it
AUTO_LEVELS = {True: "draft>retrieval>full", False: "ngram>retrieval>full"}
CPU_AUTO_LEVELS = {True: "retrieval>full", False: "ngram>retrieval>full"}
# model_type -> the name a reader knows: the families engine/model.py runs, the one list
FAMILY_NAMES = {"llama": "Llama 2/3.x", "mistral": "Mistral", "qwen2": "Qwen2/2.5", "qwen3": "Qwen3 (dense)",
                "gemma2": "Gemma 2", "gemma3_text": "Gemma 3 (text)", "phi3": "Phi-3/3.5"}


@dataclass(frozen=True)
class Levels:
    """A level stack parsed from its name (a `LEVEL_STACKS` entry), bottom up: an optional
    drafter, an optional middle level over the retrieval cache, the target with its full cache."""

    name: str
    bottom: str | None  # "ngram", "draft" (the small model), "ngram+draft" (n-grams first, then the small
    # model: engine/drafters/lookup_first.py), "selfspec" (the target); None: no drafter
    has_retrieval: bool  # a middle level: the target over the retrieval cache

    @classmethod
    def parse(cls, name: str) -> Levels:
        if name not in LEVEL_STACKS:
            raise ValueError(f"levels={name!r}; choose one of {', '.join(LEVEL_STACKS)}")
        names = ("full",) if name == "plain" else tuple(name.split(">"))
        bottom = names[0] if names[0] not in ("retrieval", "full") else None
        return cls(name, bottom, "retrieval" in names)

    @property
    def names(self) -> tuple[str, ...]:
        """From the bottom up, e.g. ("ngram", "retrieval", "full")."""
        return (self.bottom,) * bool(self.bottom) + ("retrieval",) * self.has_retrieval + ("full",)

    @property
    def needs_draft(self) -> bool:
        """The `draft` level runs the small draft model, so the engine must hold one."""
        return self.bottom in ("draft", "ngram+draft")

    def check_draft(self, draft: object | None) -> None:
        if self.needs_draft and not draft:
            raise ValueError(f"levels={self.name!r} needs a draft model: load the engine with one (--draft)")


class EngineError(Exception):
    """Base of every error a user or a file can cause; the message says what to do."""


class DocumentTooLong(EngineError):
    def __init__(self, n_tokens: int, max_tokens: int):
        super().__init__(f"The prompt has {n_tokens:,} tokens but the model's context holds {max_tokens:,}; "
                         f"shorten it by {n_tokens - max_tokens:,} tokens (keep the first part, or pick chapters).")


class EmptyPrompt(EngineError):
    def __init__(self, what: str = "prompt"):
        super().__init__(f"The {what} is empty: give at least one token of text.")


class TokenizerMismatch(EngineError):
    pass


class ModelNotFound(EngineError):
    pass


class OutOfMemoryPlan(EngineError):
    pass


class UnsupportedModel(EngineError, ValueError):
    """A checkpoint the forward would run wrong: refused from its header, before any weight is read."""

    def __init__(self, what: str, why: str):
        self.why = why
        super().__init__(f"{what} cannot run here: {why}. The families that run: {', '.join(FAMILY_NAMES.values())}.")


class Cancelled(EngineError):
    def __init__(self, what: str = "operation"):
        super().__init__(f"The {what} was cancelled.")


class BadTokens(EngineError, ValueError):
    def __init__(self, what: str, vocab_size: int):
        super().__init__(f"The {what} holds token ids outside the model's vocabulary (0..{vocab_size - 1}).")


class HeadsNotDivisible(EngineError, ValueError):
    def __init__(self, what: str, n: int, n_ranks: int):
        fits = [d for d in range(1, min(n, 8) + 1) if n % d == 0]
        super().__init__(f"Tensor parallel over {n_ranks} GPUs needs the model's {n} {what} to divide "
                         f"evenly; use one of {fits} GPUs.")


class Busy(EngineError):
    def __init__(self):
        super().__init__("This book is already answering a question: stop it or wait for it to finish.")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder shapes and family switches, read from a Hugging Face config (engine/families.py)."""

    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab_size: int
    rms_eps: float
    has_qkv_bias: bool
    has_tied_embeddings: bool
    max_positions: int
    # the per-family switches of the forward (engine/families.py refuses a config that needs others)
    has_qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head's q and k before RoPE
    is_gemma: bool = False  # (1 + w) norms, sqrt(dim) embedding scale, norms after attention and MLP, tanh GELU
    query_scale: float | None = None  # Gemma: query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5)
    attn_softcap: float | None = None  # Gemma 2: scores become cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    sliding_window: int | None = None  # keys a sliding layer's query sees, its own included
    sliding_layers: tuple[bool, ...] = ()  # per layer: whether it attends within `sliding_window` only
    has_local_rope: bool = False  # Gemma 3: sliding layers rotate with their own RoPE base

    @classmethod
    def from_hf(cls, hf) -> ModelConfig:
        n_heads = hf.num_attention_heads
        n_kv_heads = getattr(hf, "num_key_value_heads", None) or n_heads
        if n_heads % n_kv_heads:
            raise ValueError(f"{n_heads} query heads are not a multiple of {n_kv_heads} KV heads")
        window = getattr(hf, "sliding_window", None)
        layer_types = getattr(hf, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * \
            hf.num_hidden_layers  # Mistral, Phi-3: one window on every layer, or none
        is_gemma = hf.model_type in ("gemma2", "gemma3_text")
        return cls(
            n_layers=hf.num_hidden_layers,
            dim=hf.hidden_size,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // n_heads,
            intermediate=hf.intermediate_size,
            vocab_size=hf.vocab_size,
            rms_eps=hf.rms_norm_eps,
            has_qkv_bias=hf.model_type == "qwen2" or bool(getattr(hf, "attention_bias", False)),
            has_tied_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_positions=hf.max_position_embeddings,
            has_qk_norm=hf.model_type in ("qwen3", "gemma3_text"),
            is_gemma=is_gemma,
            query_scale=hf.query_pre_attn_scalar ** -0.5 if is_gemma else None,
            attn_softcap=getattr(hf, "attn_logit_softcapping", None),
            final_softcap=getattr(hf, "final_logit_softcapping", None),
            sliding_window=window if "sliding_attention" in layer_types else None,
            sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
            has_local_rope=hf.model_type == "gemma3_text",
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V for one token across all layers."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * dtype_bytes

    def check_shardable(self, n_ranks: int) -> None:
        """Tensor parallel splits query heads, KV heads and MLP columns evenly over the ranks."""
        parts = (("query heads", self.n_heads), ("KV heads", self.n_kv_heads), ("MLP columns", self.intermediate))
        for what, n in parts:
            if n % n_ranks:
                raise HeadsNotDivisible(what, n, n_ranks)


@dataclass(frozen=True)
class RetrievalConfig:
    """The middle level's cache (docs/ALGORITHM.md section 4)."""

    budget_tokens: int = 1024  # KV entries per head the middle level reads; ~6% of a 16K book
    sink_tokens: int = 16  # attention sinks at the start of the document
    window_tokens: int = 128  # recent tokens always kept, as the question's end lives there
    chunk_tokens: int = 16  # retrieval granularity; TriForce uses 8-16
    n_score_queries: int = 16  # last query positions whose attention scores the chunks
    rebuild_every_tokens: int = 256  # re-score the chunks after this many generated tokens
    rebuild_below_acceptance: float = 0.4  # ... or when the middle level's acceptance drops below

    def __post_init__(self):
        if self.budget_tokens < self.sink_tokens + self.window_tokens + self.chunk_tokens:
            raise ValueError(f"budget_tokens={self.budget_tokens} must hold sinks ({self.sink_tokens}), "
                             f"window ({self.window_tokens}) and at least one chunk ({self.chunk_tokens})")


@dataclass(frozen=True)
class EngineConfig:
    target: str = "qwen2.5-coder-1.5b"  # a folder, GGUF file, hub id or packaged name; the 0.5B garbles answers
    draft: str | None = "auto"  # small model for the `draft` level (same tokenizer); "auto": PAIRED_DRAFTS
    levels: str = "auto"  # a LEVEL_STACKS entry; "auto": AUTO_LEVELS, or CPU_AUTO_LEVELS on a CPU
    # YaRN RoPE scaling for books beyond the native context (Qwen2.5's recipe: 4 -> 131,072 tokens);
    # static, so it changes answers on short books too: 1 = off
    yarn_factor: float = 1.0
    device: str = "auto"  # "auto" picks cuda when present, else cpu
    dtype: str = "auto"  # "auto": bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16, else float32
    retrieval: RetrievalConfig = RetrievalConfig()
    prefill_chunk_tokens: int = 512  # smaller chunks cancel sooner; on a CPU larger ones prefill no faster
    streaming_sink_tokens: int = 4  # StreamingLLM cache of the draft / self-speculation level
    streaming_window_tokens: int = 256
    max_ngram: int = 4  # longest suffix the context database matches
    gamma_bottom: int | None = None  # None: adaptive (docs/ALGORITHM.md section 6)
    gamma_middle: int | None = None
    max_gamma: int = 8  # upper bound for adaptive draft lengths
    offload_kv: bool = False  # full cache in host memory, streamed to the GPU per layer (kv/offload.py)
    offload_max_gamma: int = 16  # max_gamma with offload_kv: a check waits on PCIe, so longer drafts pay
    resident_kv_layers: int | None = None  # with offload_kv: first layers kept on the GPU; None: planner
    n_gpus: int = 1  # tensor-parallel ranks (engine/parallel.py); 1 runs in this process
    use_flash_attn: bool = True  # on CUDA when installed; torch SDPA otherwise (exact either way)
    use_cpu_kernel: bool = True  # engine/csrc's AVX2 attention on CPU (faster at long context); else SDPA
    use_cuda_graphs: bool = False  # off by default, as torch.compile (docs/STYLE.md 5); eager on CPU
    # the levels below the top read a GGUF's blocks with int8 activations (engine/quant.py `quick_view`):
    # lossy, which costs only acceptance, as the top's check stays exact
    quick_drafts: bool = True

    @property
    def gamma_limit(self) -> int:
        """The upper bound of adaptive draft lengths this configuration runs with."""
        return self.offload_max_gamma if self.offload_kv else self.max_gamma

    def __post_init__(self):
        if self.draft in ("auto", "none", ""):
            object.__setattr__(self, "draft", PAIRED_DRAFTS.get(self.target) if self.draft == "auto" else None)
        if self.levels == "auto":
            from engine.device import pick_device

            table = CPU_AUTO_LEVELS if pick_device(self.device).type == "cpu" else AUTO_LEVELS
            object.__setattr__(self, "levels", table[self.draft is not None])
        if not 1 <= self.yarn_factor <= 8:
            raise ValueError(f"yarn_factor={self.yarn_factor}: 1 (off) to 8 (4 gives Qwen2.5 131,072 tokens)")
        Levels.parse(self.levels).check_draft(self.draft)
        if self.prefill_chunk_tokens < 1 or self.max_gamma < 1 or self.offload_max_gamma < 1:
            raise ValueError("prefill_chunk_tokens, max_gamma and offload_max_gamma must be at least 1")
        if self.n_gpus < 1 or (self.resident_kv_layers or 0) < 0:
            raise ValueError(f"n_gpus={self.n_gpus} must be at least 1 and resident_kv_layers="
                             f"{self.resident_kv_layers} at least 0")


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy (its own argmax branch, never max(T, eps))
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 256
    seed: int = 0  # one torch.Generator per request, so a run is reproducible from its seed
    min_p: float = 0.0  # keep tokens at least min_p x the most likely one's probability; 0 = off
    # penalties on the tokens already in the answer (sampling.penalize); 1.0 / 0.0 = off
    repetition_penalty: float = 1.0  # as Hugging Face: positive logits / p, negative x p
    presence_penalty: float = 0.0  # as OpenAI: logit - presence for each token seen once or more
    frequency_penalty: float = 0.0  # ... - frequency x its count
    # first position the penalties count; None: the answer's first token (set by Session.ask)
    penalty_start: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError(f"top_k must be >= 0 (got {self.top_k}) and max_new_tokens >= 1 "
                             f"(got {self.max_new_tokens})")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2] (0 = off), got "
                             f"{self.presence_penalty} and {self.frequency_penalty}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


# the settings a reader, a flag or a request sets, {name: int or float}: every field but `penalty_start`;
# the CLIs' flags (tools/flags.py), the API's request fields and the UI's controls are these
SAMPLING_FIELDS = {f.name: type(f.default) for f in fields(SamplingConfig) if f.default is not None}
ANSWER_TOKENS = 512  # `--max-new-tokens`'s default in app.py, `python -m tools generate` and `python -m api`
