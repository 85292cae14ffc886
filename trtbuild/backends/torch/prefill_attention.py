"""Which kernel the prefill graph's causal attention uses: SDPA's dispatch or cuDNN's fused attention.

On CUDA, SDPA takes FlashAttention-2 first and cuDNN's attention only fourth, whatever the GPU. On
Hopper cuDNN's kernel may be the faster one for a prompt's causal attention, so a build times both on
the model's head shape and compiles the faster into the prefill graph, like the decode matmuls (tactic
selection). The timing is kept in the tactic cache, so a rebuild makes the same choice (a different one
would be a different prefill graph, compiled again) and times nothing.

Both are timed as the prefill runs them: replayed from a captured CUDA graph (prefill_graphs.py, the
default on CUDA), at a short prompt as well as long ones, and cuDNN is taken only where it is faster in
all and no slower at any length. Where the prefill is called directly instead (TRTBUILD_PREFILL_GRAPHS=0),
each cuDNN call also costs ~100 us of host time (an execution-plan lookup and its allocations): on an
H100 (2026-12-06, torch 2.11, cuDNN 9.19) that made the 1B engine's 128-token prefill host-bound, 5.8 ms
for kernels that took 1.45 ms, and choosing by host-issued timings instead kept cuDNN out of long prompts,
where its kernel is the faster (prefill 2048: 8.32 ms with it, 8.87 without).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import time
from collections.abc import Iterator
from typing import Any

from trtbuild.backends import BuildJob
from trtbuild.errors import TrtbuildError

# options.prefill_attention: auto = cuDNN's attention where the build measures it faster than SDPA's
# dispatch by MARGIN (CUDA builds; CPU builds keep sdpa); sdpa = never; cudnn = always, or a recipe
# error where it cannot serve (a CPU build, or cuDNN refusing the shape). The first mode is the default.
PREFILL_ATTENTION_MODES = ("auto", "sdpa", "cudnn")
OPTIONS = {"prefill_attention": PREFILL_ATTENTION_MODES}
# auto takes cuDNN's kernel only when it measures at least this much faster: on the H200 (torch 2.11,
# cuDNN 9.19; RESULTS.md) the two ran within 1-5% of each other at Llama-3 shapes, either
# ahead, and a tie should keep the kernel SDPA itself would pick rather than follow the timing's noise.
MARGIN = 0.03


TIE_US = 1.0  # microseconds a call within which cuDNN counts as no slower at a length (slower_somewhere)
SHORT = 128  # a short prompt, where a kernel's host cost shows: the chat turn a server prefills most often


def lengths(max_input_len: int) -> list[int]:
    """Prompt lengths the choice is timed at: a short prompt (SHORT tokens), the longest prompt the engine
    takes (capped at 4096, beyond which the shares stay put) and a quarter of it."""
    top = min(max_input_len, 4096)
    return sorted({min(SHORT, top), max(16, top // 4), top})


def plan(cfg: Any, dtype: Any, mode: str, device: str, max_input_len: int, job: BuildJob) -> dict[str, Any]:
    """{"used": "sdpa" | "cudnn", "note", and on CUDA "timings": the measurement the choice came from}."""
    if mode == "sdpa":
        return {"used": "sdpa", "note": "options.prefill_attention is sdpa"}
    if not device.startswith("cuda"):
        if mode == "cudnn":
            raise TrtbuildError("options.prefill_attention: 'cudnn' cannot serve a CPU build (cuDNN is CUDA only); "
                                "use auto or sdpa")
        return {"used": "sdpa", "note": "sdpa: a CPU build"}
    timings = _cached_timings(cfg, dtype, max_input_len, job)
    failure = timings.get("cudnn_error")
    if mode == "cudnn":
        if failure:
            raise TrtbuildError(f"options.prefill_attention: 'cudnn' cannot serve this model: {failure}")
        return {"used": "cudnn", "note": "options.prefill_attention is cudnn", "timings": timings}
    faster = not failure and timings["cudnn_us"] < (1 - MARGIN) * timings["sdpa_us"] and not slower_somewhere(timings)
    why = f"cuDNN failed: {failure}" if failure else \
        f"{timings['cudnn_us']:.0f} us with cudnn against {timings['sdpa_us']:.0f} us with sdpa " \
        f"(cudnn only if {MARGIN:.0%} faster in all and no slower at any length: {_per_length(timings)})"
    return {"used": "cudnn" if faster else "sdpa", "note": f"auto: {why}", "timings": timings}


def slower_somewhere(timings: dict[str, Any]) -> bool:
    """Whether cuDNN measured slower than SDPA at any of the lengths, by more than a tie: 1%, or TIE_US a call
    where that is more (a short prompt's attention takes a few microseconds a layer, where 1% is noise and
    a microsecond is ~1% of the whole prefill)."""
    per = timings.get("per_length", {})
    return any(v["cudnn_us"] > max(1.01 * v["sdpa_us"], v["sdpa_us"] + TIE_US) for v in per.values())


def _per_length(timings: dict[str, Any]) -> str:
    per = timings.get("per_length", {})
    return ", ".join(f"{t}: {v['cudnn_us']:.0f}/{v['sdpa_us']:.0f} us" for t, v in per.items()) or "n/a"


def _cached_timings(cfg: Any, dtype: Any, max_input_len: int, job: BuildJob) -> dict[str, Any]:
    """`measure`, kept in the tactic cache (which is per GPU and toolchain) under the head shape, dtype,
    lengths and cuDNN's version."""
    import torch

    from trtbuild.store.tactics import write_atomic

    identity = {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "dtype": str(dtype),
                "lengths": lengths(max_input_len), "cudnn": torch.backends.cudnn.version(), "timed": "graph-replayed"}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    cached = job.tactics.path / "prefill_attention" / f"{digest}.json"
    if cached.is_file():
        result: dict[str, Any] = json.loads(cached.read_text()) | {"reused": True}
        return result
    job.progress(f"timing the prefill attention at prompt lengths {identity['lengths']}: sdpa and cudnn")
    result = measure(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype, identity["lengths"])
    write_atomic(cached, json.dumps(result, indent=1, sort_keys=True).encode())
    return result


def measure(heads: int, kv_heads: int, head_dim: int, dtype: Any, lens: list[int], reps: int = 20) -> dict[str, Any]:
    """Microseconds of one causal attention per kernel, summed over `lens` and per length in "per_length"
    (batch 1, random inputs in the model's layout: q, k and v are transposed views of (1, T, heads, D)
    rows, as the QKV split leaves them), the median of `reps` replays of a CUDA graph of ten calls; plus cuDNN's first call at each new length
    (it builds an execution plan per shape, which a new prompt length pays once per process) and the
    largest difference from SDPA's output. cuDNN's error, if it refuses, in "cudnn_error"."""
    import torch

    from trtbuild.models.llama import causal_attention

    out: dict[str, Any] = {"lengths": lens, "sdpa_us": 0.0, "cudnn_us": 0.0, "cudnn_first_call_ms": [],
                           "max_abs_diff": 0.0, "per_length": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in lens:
        q, k, v = (torch.randn(1, t, h, head_dim, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
                   for h in (heads, kv_heads, kv_heads))
        ref = causal_attention(q, k, v, "sdpa")
        sdpa_us = _replayed_us(functools.partial(causal_attention, q, k, v, "sdpa"), reps)
        out["sdpa_us"] += sdpa_us
        if "cudnn_error" in out:
            continue
        try:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            y = causal_attention(q, k, v, "cudnn")
            torch.cuda.synchronize()
            out["cudnn_first_call_ms"].append(round((time.perf_counter() - t0) * 1e3, 3))
        except RuntimeError as e:
            out["cudnn_error"] = str(e).splitlines()[0][:300]
            continue
        diff = (y.float() - ref.float()).abs().max().item()
        out["max_abs_diff"] = max(out["max_abs_diff"], diff)
        if not diff <= 0.02 * ref.float().abs().max().item() + 1e-3:  # NaN fails too
            out["cudnn_error"] = f"output differs from sdpa's by {diff:.3g} at length {t}"
            continue
        cudnn_us = _replayed_us(functools.partial(causal_attention, q, k, v, "cudnn"), reps)
        out["cudnn_us"] += cudnn_us
        out["per_length"][str(t)] = {"sdpa_us": round(sdpa_us, 2), "cudnn_us": round(cudnn_us, 2)}
    return out


def _replayed_us(call: Any, reps: int) -> float:
    """Microseconds of one `call`: ten calls captured in a CUDA graph and replayed, as the prefill graph replays
    its layers' attention, so only the kernels' device time counts (a kernel's host cost is paid at capture)."""
    from trtbuild.timing import graph_seconds

    def ten() -> None:
        for _ in range(10):
            call()

    return graph_seconds(ten, reps) / 10 * 1e6


@contextlib.contextmanager
def routed(model: Any, kernel: str) -> Iterator[None]:
    """Every Attention's prompt attention through `kernel`, for one export of the prefill graph."""
    from trtbuild.models.llama import Attention

    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    for a in attentions:
        a.prefill_kernel = kernel
    try:
        yield
    finally:
        for a in attentions:
            a.prefill_kernel = "sdpa"
