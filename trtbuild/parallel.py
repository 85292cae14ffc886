"""Tensor parallelism: how a model's weights split across ranks, and the launcher that starts the ranks.

The split is the standard one (Megatron-LM's, TensorRT-LLM's): the Q/K/V and gate/up projections are
column-parallel (each rank owns whole heads and a slice of the intermediate size), the attention output
and down projections are row-parallel (each rank multiplies its slice of the input and an all-reduce sums
the partial results), and the embedding table and LM head are split along the vocabulary (padded to a
multiple of the rank count). Everything else (the norms, qk-norms) is replicated.

The plan works on this project's fused layout (`models/checkpoint.convert_hf_state_dict`): `wqkv` holds
[q | k | v] rows and `w13` holds [gate | up] rows, so each part is split on its own and the rank's parts
are concatenated again. `unshard` is the exact inverse, which the tests check.

`Ranks` starts N processes, each with a `torch.distributed` process group (gloo on the CPU, NCCL on
GPUs) and one object built by a factory, and calls a method on every rank at once: the user needs no
torchrun. A leaf module: torch is imported inside the functions.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import traceback
from collections.abc import Callable
from typing import Any

from trtbuild.errors import InputError, TrtbuildError

# What each parameter of a layer does under the split, by the end of its name.
COLUMN_QKV = "qkv"  # rows [q | k | v]: each part split by heads
COLUMN_GATE_UP = "gate_up"  # rows [gate | up]: each half split
ROW = "row"  # columns split; the bias stays whole, added once after the all-reduce
VOCAB = "vocab"  # rows split along the vocabulary, padded to a multiple of tp
REPLICATE = "replicate"

_PLAN = (
    ("attention.wqkv.weight", COLUMN_QKV), ("attention.wqkv.bias", COLUMN_QKV),
    ("attention.wo.weight", ROW), ("attention.wo.bias", REPLICATE),
    ("feed_forward.w13.weight", COLUMN_GATE_UP), ("feed_forward.w13.bias", COLUMN_GATE_UP),
    ("feed_forward.w2.weight", ROW), ("feed_forward.w2.bias", REPLICATE),
    ("tok_embeddings.weight", VOCAB), ("output.weight", VOCAB),
)


def split_of(name: str) -> str:
    """How the parameter `name` (fused layout) splits across ranks: one of the constants above."""
    for suffix, kind in _PLAN:
        if name.endswith(suffix):
            return kind
    return REPLICATE


def check_divisible(cfg: Any, tp: int, source: str = "model.config") -> None:
    """Raise InputError naming each config field that does not divide by `tp` (heads, KV heads, the MLP);
    `source` says where the config came from (the recipe's model.config, or a config.json's path)."""
    problems = tp_problems(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, tp, source)
    if getattr(cfg, "num_experts", 0) and tp > 1:
        problems.append(f"parallel.tp: tensor parallelism does not split a mixture of experts ({source}) yet")
    if problems:
        raise InputError("; ".join(problems))


def tp_problems(heads: int, kv_heads: int, intermediate: int, tp: int, source: str) -> list[str]:
    """The fields of a model config that `tp` ranks cannot split evenly, as `field.path: message`."""
    return [f"parallel.tp: {tp} does not divide {field} ({value}) of {source}" for field, value in
            (("num_attention_heads", heads), ("num_key_value_heads", kv_heads), ("intermediate_size", intermediate))
            if value % tp]


def vocab_shard(vocab_size: int, tp: int) -> int:
    """Rows of the embedding table and LM head each rank holds: the vocabulary padded to a multiple of tp."""
    return -(-vocab_size // tp)


def rank_config(cfg: Any, tp: int, vocab: str = "full") -> Any:
    """One rank's share of a model config (a `models.llama.LlamaConfig`): heads, KV heads and the
    intermediate size divided by tp; the vocabulary whole (`vocab="full"`: what the runtime checks token
    ids against) or the rank's padded slice (`"shard"`: the size of its embedding table and LM head)."""
    check_divisible(cfg, tp)
    share = {"num_heads": cfg.num_heads // tp, "num_kv_heads": cfg.num_kv_heads // tp,
             "intermediate_size": cfg.intermediate_size // tp}
    if vocab == "shard":
        share["vocab_size"] = vocab_shard(cfg.vocab_size, tp)
    return dataclasses.replace(cfg, **share)


def _qkv_sizes(cfg: Any) -> list[int]:
    return [cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]


def shard(state: dict[str, Any], cfg: Any, tp: int, rank: int) -> dict[str, Any]:
    """Rank `rank`'s tensors of a full fused-layout state dict, split as `split_of` says (contiguous)."""
    import torch

    check_divisible(cfg, tp)
    rows = vocab_shard(cfg.vocab_size, tp)
    out: dict[str, Any] = {}
    for name, t in state.items():
        kind = split_of(name)
        if kind == COLUMN_QKV:
            out[name] = torch.cat([part.chunk(tp, 0)[rank] for part in t.split(_qkv_sizes(cfg), 0)])
        elif kind == COLUMN_GATE_UP:
            out[name] = torch.cat([half.chunk(tp, 0)[rank] for half in t.chunk(2, 0)])
        elif kind == ROW:
            out[name] = t.chunk(tp, 1)[rank]
        elif kind == VOCAB:
            piece = t[rank * rows:(rank + 1) * rows]
            if piece.shape[0] < rows:  # the last rank's padding rows: never looked up, logits sliced off
                piece = torch.cat([piece, piece.new_zeros(rows - piece.shape[0], *piece.shape[1:])])
            out[name] = piece
        else:
            out[name] = t
        out[name] = out[name].contiguous()
    return out


def unshard(shards: list[dict[str, Any]], cfg: Any) -> dict[str, Any]:
    """The full state dict again from every rank's `shard` (in rank order): the inverse of `shard`."""
    import torch

    tp = len(shards)
    out: dict[str, Any] = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        kind = split_of(name)
        if kind == COLUMN_QKV:
            sizes = [n // tp for n in _qkv_sizes(cfg)]
            split = [p.split(sizes, 0) for p in parts]
            out[name] = torch.cat([torch.cat([s[i] for s in split]) for i in range(3)])
        elif kind == COLUMN_GATE_UP:
            halves = [p.chunk(2, 0) for p in parts]
            out[name] = torch.cat([torch.cat([h[i] for h in halves]) for i in range(2)])
        elif kind == ROW:
            out[name] = torch.cat(parts, 1)
        elif kind == VOCAB:
            out[name] = torch.cat(parts)[:cfg.vocab_size]
        else:
            out[name] = parts[0]
    return out


def distributed_backend(device: str) -> str:
    """The collective library the ranks use: NCCL between GPUs, gloo on the CPU."""
    return "nccl" if device.startswith("cuda") else "gloo"


# NVLink multicast (NVLink SHARP) stays off in NCCL, PyTorch and NVSHMEM unless the caller set otherwise: on
# hosts whose GPUs are shared, a program that uses it can put them out of service for everyone; a decode
# step's all-reduces are too small to gain from it.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _rank_main(rank: int, tp: int, host: str, port: int, backend: str, factory: Callable[..., Any],
               args: tuple[Any, ...], conn: Any) -> None:
    """One rank: join the process group, build the object, then serve calls until told to stop."""
    obj = None
    for k, v in NCCL_ENV.items():  # before torch.distributed reads them
        os.environ.setdefault(k, v)
    try:
        import torch.distributed as dist

        store = dist.TCPStore(host, port, tp + 1, False)
        import torch

        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            # The ranks share the CPU: each with torch's default of a thread a core oversubscribes it, and
            # OpenMP's spinning threads then starve the rank a collective waits for (a tiny engine's decode
            # step at tp=2 on 2 cores: 118 ms, against 5.8 ms with a thread a rank).
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // tp))
        dist.init_process_group(backend, store=store, rank=rank, world_size=tp)
        obj = factory(rank, tp, *args)
        conn.send(("ok", None))
    except BaseException as exc:
        conn.send(_failure(exc))
        return
    while True:
        try:
            method, call_args = conn.recv()
        except EOFError:  # the parent went away
            break
        if method is None:
            break
        try:
            conn.send(("ok", getattr(obj, method)(*call_args)))
        except BaseException as exc:  # sent back, so the parent raises what the rank raised
            conn.send(_failure(exc))
    try:
        import torch.distributed as dist

        dist.destroy_process_group()
    except Exception:  # a rank on its way out: nothing left to report to
        pass
    conn.close()


def _failure(exc: BaseException) -> tuple[str, Any]:
    """What a rank sends back for an exception: a TrtbuildError by its parts (a subclass's own __init__ may
    not unpickle), for the parent to raise as the user's error it is; anything else as its traceback."""
    if isinstance(exc, TrtbuildError):
        return "raise", (isinstance(exc, InputError), exc.message, exc.hint, exc.exit_code)
    return "error", "".join(traceback.format_exception(exc))


class Ranks:
    """`tp` processes, rank r holding `factory(r, tp, *args)`, in one process group; `call` runs a method
    on every rank at once (the ranks must all run each collective) and returns each rank's result.

    Started on entry, stopped on exit; nothing runs before entry. Processes are spawned, not forked: a
    forked child of a process that already used CUDA or OpenMP threads can hang."""

    def __init__(self, tp: int, device: str, factory: Callable[..., Any], args: tuple[Any, ...] = (),
                 timeout_s: float = 1800.0) -> None:
        self.tp, self.device, self.factory, self.args = tp, device, factory, args
        self.timeout_s = timeout_s
        self._procs: list[Any] = []
        self._conns: list[Any] = []

    def __enter__(self) -> "Ranks":
        import torch.distributed as dist

        # The parent hosts the rendezvous store on a port the OS picks: no port to guess, none to collide.
        self._store = dist.TCPStore("127.0.0.1", 0, self.tp + 1, True, wait_for_workers=False)
        ctx = multiprocessing.get_context("spawn")
        backend = distributed_backend(self.device)
        try:
            for rank in range(self.tp):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_rank_main, name=f"trtbuild-rank{rank}", daemon=True,
                                args=(rank, self.tp, "127.0.0.1", self._store.port, backend, self.factory,
                                      self.args, child))
                p.start()
                child.close()
                self._procs.append(p)
                self._conns.append(parent)
            self._gather()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for conn in self._conns:
            try:
                conn.send((None, ()))
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
        self._procs, self._conns = [], []

    def call(self, method: str, *args: Any) -> list[Any]:
        """`method(*args)` on every rank's object; the results in rank order. A rank's TrtbuildError is
        raised as it is; any other failure as a TrtbuildError carrying the rank's traceback."""
        if not self._conns:  # ended (a failed call ends every rank): waiting for answers would wait for nothing
            raise TrtbuildError(f"the tensor-parallel ranks have ended; '{method}' cannot run")
        for conn in self._conns:
            conn.send((method, args))
        return self._gather()

    def _gather(self) -> list[Any]:
        """Every rank's answer to the last command. Polled together: a rank that fails inside a collective
        leaves the others waiting in it, so once one has failed the rest get a short grace, then the error
        is raised (and `__exit__` ends the waiting ranks)."""
        import time

        results: dict[int, Any] = {}
        failure: BaseException | None = None
        failed_at: float | None = None
        deadline = time.monotonic() + self.timeout_s
        while len(results) < self.tp:
            for rank, (conn, proc) in enumerate(zip(self._conns, self._procs)):
                if rank in results or not conn.poll(0.05):
                    if rank not in results and not proc.is_alive() and not conn.poll(0):
                        failure = failure or TrtbuildError(f"tensor-parallel rank {rank} stopped "
                                                           f"(exit code {proc.exitcode})")
                        results[rank] = None
                    continue
                try:
                    status, value = conn.recv()
                except EOFError:
                    status, value = "error", f"the rank's process ended (exit code {proc.exitcode})"
                if status == "raise":
                    is_input, message, hint, code = value
                    failure = failure or (InputError if is_input else TrtbuildError)(message, hint, exit_code=code)
                elif status == "error":
                    failure = failure or TrtbuildError(f"tensor-parallel rank {rank} failed:\n{value}")
                results[rank] = value
            if failure is not None:
                failed_at = failed_at or time.monotonic()
                if time.monotonic() > failed_at + 10.0:
                    break
            if time.monotonic() > deadline:
                failure = failure or TrtbuildError(f"tensor-parallel ranks gave no answer in {self.timeout_s:.0f} s")
                break
        if failure is not None:
            self.__exit__()
            raise failure
        return [results[r] for r in range(self.tp)]

