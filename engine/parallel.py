"""Tensor parallelism over several GPUs (docs/ALGORITHM.md section 8); gloo on CPU in tests.

`shard` turns a loaded Transformer into one rank's part, as gpt-fast's tp.py does. How the ranks
stay in step (rank 0's `Leader.call`, `everywhere`, `follow`): engine/README.md "The request
protocol". `start` spawns ranks 1..N-1 or joins torchrun.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from engine.batch import Batcher
from engine.config import EngineError
from engine.model import Transformer
from engine.quant import QuantEmbedding, QuantLinear, is_quantized
from engine.sampling import Coins

log = logging.getLogger(__name__)

# Every collective ends within this, or raises on every rank still in it (NCCL too: blocking
# waits), which rank 0 turns into `RankFailed`. Ranks > 0 wait inside one for rank 0's next call,
# so an idle rank 0 sends a no-op call every `HEARTBEAT_FRACTION` of it.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)
HEARTBEAT_FRACTION = 0.25
START_TIMEOUT = timedelta(minutes=5)  # the ranks meet this soon after spawning, or one failed
LOAD_TIMEOUT = timedelta(hours=2)  # spawned ranks wait this long for rank 0's model (a GGUF converts once)
READY_KEY = "bookchat/ready"
FAILURE_KEY = "bookchat/failed"  # in the spawned ranks' store: why a rank left
COMPLETED, TYPED_ERROR = 0, 1  # how a call ended on a rank (`_agree`); bad input raises alike on every rank


class RankFailed(EngineError):
    def __init__(self, detail: str):
        super().__init__(f"A tensor-parallel rank failed ({detail}). The GPUs are out of step: restart the "
                         "app (or the command); with one GPU it runs without tensor parallel.")


def _slice(linear: nn.Linear, dim: int, start: int, n: int) -> None:
    """Keep output rows (dim 0) or input columns (dim 1) start..start+n-1, as new tensors."""
    linear.weight = nn.Parameter(linear.weight.narrow(dim, start, n).clone(), requires_grad=False)
    if dim == 0 and linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.narrow(0, start, n).clone(), requires_grad=False)
    linear.out_features, linear.in_features = linear.weight.shape


def _all_reduce(module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(output)  # sum of the ranks' partial products
    return output


def dequantize(model: Transformer) -> None:
    """Replace every GGUF block linear and embedding (engine/quant.py) in place by a plain one of
    the model's dtype (the file's values in float32, then cast): a row of blocks cannot be split
    by columns, and the blocks' kernel runs on a CPU only. Tied embeddings stay tied."""
    dtype = model.model.norm.weight.dtype
    for name, child in list(model.named_modules()):
        if isinstance(child, QuantLinear):
            dense = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
            dense.weight = nn.Parameter(child.dequantized().to(dtype), requires_grad=False)
            if child.bias is not None:
                dense.bias = nn.Parameter(child.bias.to(dtype), requires_grad=False)
            model.set_submodule(name, dense)
        elif isinstance(child, QuantEmbedding):
            table = child(torch.arange(child.weight.shape[0]))  # [V, dim] float32: every id's row
            model.set_submodule(name, nn.Embedding.from_pretrained(table.to(dtype), freeze=True))
    if model.config.has_tied_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


def shard(model: Transformer, rank: int, n_ranks: int) -> Transformer:
    """Make `model` rank `rank`'s shard of `n_ranks` in place: query heads, KV heads (a KV head keeps
    its query heads) and MLP columns split evenly, the partial outputs of attention and the MLP summed
    by an all-reduce; embeddings, norms and lm_head whole. Its config then holds this rank's head counts
    and MLP width, so caches built from it are per rank. GGUF blocks are dequantized first
    (`dequantize`): sliced as bytes, they would be garbage."""
    c = model.config
    c.check_shardable(n_ranks)
    if is_quantized(model):
        dequantize(model)
    H, Hkv, F, D = c.n_heads // n_ranks, c.n_kv_heads // n_ranks, c.intermediate // n_ranks, c.head_dim
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        # each rank keeps its n-wide part; HF layout: a KV head's query heads are adjacent, so q and kv align
        for linear, dim, n in ((attn.q_proj, 0, H * D), (attn.k_proj, 0, Hkv * D), (attn.v_proj, 0, Hkv * D),
                               (attn.o_proj, 1, H * D), (mlp.gate_proj, 0, F), (mlp.up_proj, 0, F),
                               (mlp.down_proj, 1, F)):
            _slice(linear, dim, rank * n, n)
        attn.n_heads, attn.n_kv_heads = H, Hkv
        # on the blocks, not on o_proj/down_proj (their outputs are the blocks'): the engine may
        # swap the linears for packed ones afterwards (engine/layouts.py)
        attn.register_forward_hook(_all_reduce)
        mlp.register_forward_hook(_all_reduce)
    model.config = replace(c, n_heads=H, n_kv_heads=Hkv, intermediate=F)
    return model


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def shared(value: int | float, dtype: torch.dtype = torch.float64) -> int | float:
    """Rank 0's `value` on every rank, exactly: the tuners' `share` under tensor parallel."""
    t = torch.tensor([value], dtype=dtype, device=_device())
    dist.broadcast(t, src=0)
    return t.item()


def gathered(value):
    """Every rank's `value` (picklable), in rank order; [value] without a process group."""
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _agree(status: int) -> None:
    """Raise unless every rank ended the last call the same way (a collective)."""
    t = torch.tensor([status, -status], device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # [max, -min] of the ranks' statuses
    if int(t[0]) != -int(t[1]):
        raise RuntimeError("the ranks ended a call differently")


class SharedCoins:
    """Rank 0 draws with its coins; every rank gets the outcome, so all accept and emit alike."""

    def __init__(self, coins: Coins):
        self.coins = coins if dist.get_rank() == 0 else None

    def accept(self, p: float) -> bool:
        return bool(shared(int(self.coins.accept(p)) if self.coins else 0, torch.long))

    def sample(self, probs: torch.Tensor) -> int:
        return shared(self.coins.sample(probs) if self.coins else 0, torch.long)


class SharedFlag:
    """Rank 0's cancel flag, read at the same points on every rank."""

    def __init__(self, flag):
        self.flag = flag if dist.get_rank() == 0 else None

    def is_set(self) -> bool:
        return bool(shared(int(self.flag is not None and self.flag.is_set()), torch.long))


@dataclass
class Ranks:
    """What every rank holds: its engine, its sessions by the id rank 0 gave them, and (ranks > 0)
    its copy of rank 0's batch (engine/batch.py `round_on_every_rank`)."""

    engine: object
    sessions: dict = field(default_factory=dict)
    batcher: Batcher = field(default_factory=lambda: Batcher(max_active=1 << 30, background=False, in_step=True))


def everywhere(method: Callable) -> Callable:
    """For the `Session` methods that change a session: on rank 0 of a tensor-parallel engine (the
    session's `leader` set), the same call is made on every rank's copy of the session, in step."""
    @functools.wraps(method)
    def call(session, *args, **kwargs):
        if session.leader is None:
            return method(session, *args, **kwargs)
        return session.leader.call(_method, session.sid, method.__name__, args, kwargs)
    return call


# Calls made on every rank: fn(ranks, *broadcast args, **rank 0's local arguments)
def _method(ranks: Ranks, sid: int, name: str, args: tuple, kwargs: dict):
    session = ranks.sessions[sid]
    return getattr(type(session), name).__wrapped__(session, *args, **kwargs)


def _open(ranks: Ranks, sid: int, doc_ids: list[int], n_first=None, on_progress=None, cancel=None):
    ranks.sessions[sid] = ranks.engine.open(doc_ids, on_progress, SharedFlag(cancel), n_first)


def read(ranks: Ranks, sid: int, ids: list[int], on_progress=None, cancel=None):
    ranks.sessions[sid].read_here(ids, on_progress, SharedFlag(cancel))


def _restore(ranks: Ranks, sid: int, path: str, n_total: int | None = None, doc_ids=None):
    """Each rank memory-maps the snapshot and takes its own KV and query heads."""
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    c, r = ranks.engine.target.config, dist.get_rank()
    state["cache"] = {name: t.narrow(2, r * c.n_kv_heads, c.n_kv_heads) for name, t in state["cache"].items()}
    state["queries"] = [q if q is None else q.narrow(1, r * c.n_heads, c.n_heads) for q in state["queries"]]
    ranks.sessions[sid] = ranks.engine.restore_state(state, n_total, doc_ids)


def _gathered_heads(t: torch.Tensor) -> torch.Tensor | None:
    """Every rank's `t` ([L, B, H, ...], host) joined along its heads, on rank 0 (None elsewhere);
    one layer at a time through this rank's device, so no device holds more than one layer."""
    device, is_root = _device(), dist.get_rank() == 0
    layers = []
    for part in t.unbind(0):  # [B, H, ...]
        part = part.contiguous().to(device)
        parts = [torch.empty_like(part) for _ in range(dist.get_world_size())] if is_root else None
        dist.gather(part, parts, dst=0)
        if is_root:
            layers.append(torch.cat(parts, dim=1).cpu())
    return torch.stack(layers) if is_root else None


def whole_state(state: dict) -> dict | None:
    """A snapshot's state (`Session.state`) with every rank's KV and query heads, on rank 0 (None
    elsewhere): the same format as one process's, so the library stores and verifies one file
    (and any number of ranks restores it, `_restore`)."""
    cache = {name: _gathered_heads(t) for name, t in state["cache"].items()}  # [L, B, Hkv, S, D]
    queries = [None] * len(state["queries"])  # kept when every layer has them
    if all(q is not None for q in state["queries"]):
        queries = _gathered_heads(torch.stack(state["queries"]))  # [L, B, H, M, D]
    if dist.get_rank() > 0:
        return None
    return state | {"cache": cache, "queries": list(queries)}


def _idle(ranks: Ranks):
    """Rank 0's heartbeat: keeps idle ranks' waits shorter than the collective timeout."""


class Leader:
    """Rank 0's engine: calls that run the model are made on every rank, one at a time (`call`);
    reads (tokenizer, config, max_context ...) go to the local engine."""

    def __init__(self, engine, workers: list, store=None, timeout: timedelta = COLLECTIVE_TIMEOUT):
        self.engine, self.workers, self.store = engine, workers, store
        self.heartbeat_s = timeout.total_seconds() * HEARTBEAT_FRACTION
        self.ranks, self.next_sids = Ranks(engine), itertools.count()
        self.lock = threading.RLock()  # one call at a time: the ranks' collectives pair up in order
        self.batcher = Batcher(max_active=64)  # the answers of `Session.ask` (the app has its own): as many as come
        self.failure: str | None = None  # why the ranks fell out of step; every later call raises it
        self.closed = threading.Event()
        threading.Thread(target=self._heartbeat, name="tp-heartbeat", daemon=True).start()

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def call(self, fn: Callable, *args, **local):
        """fn(ranks, *args) on every rank; rank 0 also passes `local` (callbacks, flags)."""
        with self.lock:
            if self.failure is not None:
                raise RankFailed(self.failure)
            try:
                dist.broadcast_object_list([(fn, args)], src=0)
                result = fn(self.ranks, *args, **local)
            except (EngineError, ValueError):
                self.agree(TYPED_ERROR)
                raise
            except Exception as error:  # noqa: BLE001 (a collective failed, or this rank did: out of step)
                self.fail(error)
            self.agree(COMPLETED)
            return result

    def agree(self, status: int) -> None:
        try:
            _agree(status)
        except Exception as error:  # noqa: BLE001 (a collective failed, or the ranks disagree)
            self.fail(error)

    def fail(self, error: Exception):
        """The ranks are out of step: say why (the failed rank's own words when it left them in
        the store), leave the group so the other ranks' collectives end, and raise RankFailed."""
        detail = f"{type(error).__name__}: {error}"
        if self.store is not None:
            with contextlib.suppress(Exception):  # no rank left a message: this rank's error is the news
                self.store.wait([FAILURE_KEY], timedelta(seconds=2))
                detail = self.store.get(FAILURE_KEY).decode()
        self.failure = self.failure or detail
        _leave_group()
        raise RankFailed(self.failure) from error

    def _heartbeat(self) -> None:
        while not self.closed.wait(self.heartbeat_s):
            if self.lock.acquire(blocking=False):  # busy: the ranks are talking anyway
                try:
                    if self.failure is None and not self.closed.is_set():
                        with contextlib.suppress(RankFailed):  # the next call says so
                            self.call(_idle)
                finally:
                    self.lock.release()

    def open(self, doc_ids: list[int], on_progress=None, cancel=None, n_first: int | None = None):
        return self._new_session(_open, list(doc_ids), n_first, on_progress=on_progress, cancel=cancel)

    def restore(self, path, n_total: int | None = None, doc_ids: list[int] | None = None):
        return self._new_session(_restore, str(path), n_total, doc_ids)

    def _new_session(self, fn: Callable, *args, **local):
        sid = next(self.next_sids)
        self.call(fn, sid, *args, **local)  # fn(ranks, sid, *args) makes the session on every rank
        session = self.ranks.sessions[sid]
        session.sid, session.leader = sid, self  # rank 0's copy: it makes the changes on every rank
        return session

    def close(self) -> None:
        """Stop the other ranks and leave the process group."""
        with self.lock:
            self.closed.set()
            if self.failure is None:
                dist.broadcast_object_list([(None, ())], src=0)
            for worker in self.workers:
                worker.join(timeout=60 if self.failure is None else 5)
                if worker.is_alive():  # hung (in a forward, a kernel): it cannot rejoin, end it
                    worker.kill()
                    worker.join(timeout=5)
            _leave_group()


def follow(engine, store=None) -> None:
    """Ranks > 0: make every call rank 0 broadcasts, until it closes. Any other failure (out of
    memory, a bug, rank 0 gone) leaves this rank out of step for good: it says why in `store` and
    exits, which ends rank 0's waiting collective (gloo at once, NCCL at its timeout)."""
    ranks = Ranks(engine)
    try:
        while True:
            message = [None]
            dist.broadcast_object_list(message, src=0)
            fn, args = message[0]
            if fn is None:
                dist.destroy_process_group()
                return
            try:
                fn(ranks, *args)
                status = COMPLETED
            except (EngineError, ValueError):
                status = TYPED_ERROR  # rank 0 raised the same error to its caller
            _agree(status)
    except Exception as error:  # noqa: BLE001
        detail = f"rank {dist.get_rank()}: {type(error).__name__}: {error}"
        if store is not None:
            with contextlib.suppress(Exception):
                store.set(FAILURE_KEY, detail)
        log.error("tensor-parallel %s", detail)
        os._exit(1)  # a rank out of step cannot rejoin the collectives: leave them


def _leave_group() -> None:
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def rank_device(device: torch.device) -> torch.device:
    """This rank's device: the GPU `_join` made current, or the CPU for gloo."""
    return _device() if device.type == "cuda" else device


def nccl_environment(n_ranks: int) -> dict[str, str]:
    """NCCL's settings for GPUs 0..n_ranks-1, set in os.environ before the group is made (a user's
    own values win); returns them. Without peer-to-peer access (RTX 4090s) NCCL's P2P transport
    hangs: go through host memory. Blocking waits make a timed-out collective raise (`RankFailed`)
    instead of NCCL's watchdog ending the process."""
    settings = {"TORCH_NCCL_BLOCKING_WAIT": "1"}
    if any(not torch.cuda.can_device_access_peer(i, j) for i in range(n_ranks) for j in range(n_ranks) if i != j):
        settings["NCCL_P2P_DISABLE"] = "1"
    for name, value in settings.items():
        os.environ.setdefault(name, value)
    return settings


def _join(rank: int, n_ranks: int, store, device: torch.device, timeout: timedelta = COLLECTIVE_TIMEOUT) -> None:
    """Join the group: through `store` (spawned ranks), or without one at torchrun's MASTER_ADDR
    and MASTER_PORT (torch's "env://")."""
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        nccl_environment(n_ranks)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # the ranks meet within START_TIMEOUT (spawning, importing torch); collectives then get `timeout`
    dist.init_process_group(backend, store=store, rank=rank, world_size=n_ranks, timeout=max(timeout, START_TIMEOUT))
    dist.distributed_c10d._set_pg_timeout(timeout)


def _serve(rank: int, make_engine: Callable, n_ranks: int, port: int, device: torch.device, n_threads: int,
           timeout: timedelta):
    torch.set_num_threads(n_threads)
    store = dist.TCPStore("127.0.0.1", port, n_ranks, False, timeout=START_TIMEOUT)
    _join(rank, n_ranks, store, device, timeout)
    engine = make_engine()
    store.wait([READY_KEY], LOAD_TIMEOUT)  # not in a collective: rank 0 may load (or convert) for long
    follow(engine, store)


def start(make_engine: Callable[[], object], n_ranks: int, device: torch.device,
          timeout: timedelta = COLLECTIVE_TIMEOUT) -> Leader:
    """Rank 0's engine over `n_ranks` processes; `make_engine()` builds one rank's engine (its
    shard) once the process group is up, and must pickle. Under torchrun every process calls
    this: ranks > 0 serve until rank 0 closes, then exit. Otherwise this process is rank 0 and
    spawns ranks 1..n-1 on this machine. `timeout`: of every collective (tests shorten it)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        assert int(os.environ["WORLD_SIZE"]) == n_ranks, f"torchrun started {os.environ['WORLD_SIZE']} ranks"
        _join(int(os.environ["RANK"]), n_ranks, None, device, timeout)
        if dist.get_rank() > 0:
            follow(make_engine())
            sys.exit(0)
        return Leader(make_engine(), [], timeout=timeout)
    store = dist.TCPStore("127.0.0.1", 0, n_ranks, True, timeout=START_TIMEOUT,
                          wait_for_workers=False)  # port 0: the system picks a free one
    args = (make_engine, n_ranks, store.port, device, torch.get_num_threads(), timeout)
    workers = [mp.get_context("spawn").Process(target=_serve, args=(rank, *args), daemon=True)
               for rank in range(1, n_ranks)]
    for worker in workers:
        worker.start()
    _join(0, n_ranks, store, device, timeout)
    leader = Leader(make_engine(), workers, store, timeout)
    store.set(READY_KEY, "1")
    return leader
