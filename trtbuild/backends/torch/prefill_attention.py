"""Which kernel the prefill graph's causal attention uses: SDPA's dispatch or cuDNN's fused attention.

On CUDA, SDPA takes FlashAttention-2 first and cuDNN's attention only fourth, whatever the GPU. On
Hopper cuDNN's kernel may be the faster one for a prompt's causal attention, so a build times both on
the model's head shape at long prompt lengths and compiles the faster into the prefill graph, like
the decode matmuls (tactic selection). The timing is kept in the tactic cache, so a rebuild makes the
same choice (a different one would be a different prefill graph, compiled again) and times nothing.
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


def lengths(max_input_len: int) -> list[int]:
    """Prompt lengths the choice is timed at: the longest prompt the engine takes (capped at 4096,
    beyond which the shares stay put) and a quarter of it, where attention is a smaller share."""
    top = min(max_input_len, 4096)
    return sorted({max(16, top // 4), top})


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
    faster = not failure and timings["cudnn_us"] < (1 - MARGIN) * timings["sdpa_us"]
    why = f"cuDNN failed: {failure}" if failure else \
        f"{timings['cudnn_us']:.0f} us with cudnn against {timings['sdpa_us']:.0f} us with sdpa " \
        f"(cudnn only if {MARGIN:.0%} faster)"
    return {"used": "cudnn" if faster else "sdpa", "note": f"auto: {why}", "timings": timings}


def _cached_timings(cfg: Any, dtype: Any, max_input_len: int, job: BuildJob) -> dict[str, Any]:
    """`measure`, kept in the tactic cache (which is per GPU and toolchain) under the head shape, dtype,
    lengths and cuDNN's version."""
    import torch

    from trtbuild.store.tactics import write_atomic

    identity = {"heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "dtype": str(dtype),
                "lengths": lengths(max_input_len), "cudnn": torch.backends.cudnn.version()}
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
    """Microseconds of one causal attention per kernel, summed over `lens` (batch 1, random inputs in the
    model's layout: q, k and v are transposed views of (1, T, heads, D) rows, as the QKV split leaves
    them), the median of `reps` CUDA-graph replays each; plus cuDNN's first call at each new length
    (it builds an execution plan per shape, which a new prompt length pays once per process) and the
    largest difference from SDPA's output. cuDNN's error, if it refuses, in "cudnn_error"."""
    import torch

    from trtbuild.models.llama import causal_attention

    out: dict[str, Any] = {"lengths": lens, "sdpa_us": 0.0, "cudnn_us": 0.0, "cudnn_first_call_ms": [],
                           "max_abs_diff": 0.0}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for t in lens:
        q, k, v = (torch.randn(1, t, h, head_dim, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
                   for h in (heads, kv_heads, kv_heads))
        ref = causal_attention(q, k, v, "sdpa")
        out["sdpa_us"] += _graph_us(functools.partial(causal_attention, q, k, v, "sdpa"), reps)
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
        out["cudnn_us"] += _graph_us(functools.partial(causal_attention, q, k, v, "cudnn"), reps)
    return out


def _graph_us(call: Any, reps: int) -> float:
    """Microseconds of `call` replayed in a CUDA graph, ten calls a replay: timed one call at a time
    outside a graph, Python's launch of SDPA (tens of microseconds) was what the H200 measured at
    512 tokens (~60 us for either kernel), not the kernel. Where a kernel cannot be captured, ten calls
    back to back between two events (the prefill graph does not run in a CUDA graph anyway)."""
    import torch

    from trtbuild.timing import event_seconds, graph_seconds

    def ten() -> None:
        for _ in range(10):
            call()

    try:
        return graph_seconds(ten, reps) / 10 * 1e6
    except RuntimeError:
        torch.cuda.synchronize()
    return event_seconds(ten, reps) / 10 * 1e6


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
