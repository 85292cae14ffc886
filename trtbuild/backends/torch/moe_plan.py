"""How a mixture of experts' decode steps and prompts run (options.moe_decode, options.moe_prefill).

Decode steps (options.moe_decode): ATen's gather of the chosen experts'
weights (`models/moe.MoE._gathered`) or trtbuild's Triton kernel that reads them in place
(`kernels/moe_gather.py`), the latter chosen only where the build timed it faster.

- aten (the default until the kernel has run on a GPU): ATen's gather, on every device.
- auto: on CUDA, the model's own MoE layers at the largest decode batch, each way, in a CUDA graph; the
  kernel where it is faster by `MARGIN`. A kernel that fails to launch leaves ATen's. CPU builds: ATen.
- kernel: the kernel on CUDA, untimed; an error on the CPU.
Prompts (options.moe_prefill): dense (the default) or grouped by expert (`prefill_plan`).
Both choices are set on the model's MoE layers for the graphs' export (`route`, `route_prefill`), here and
in the compile workers (`compile_workers.run` takes them from the build's spec), and recorded in the
manifest.
"""

from __future__ import annotations

import statistics
from typing import Any

from trtbuild.errors import TrtbuildError

MOE_DECODE_MODES = ("aten", "auto", "kernel")
# options.moe_prefill: dense = every expert on every token, the unchosen weighted by zero (any dtype);
# grouped = the tokens sorted by expert, a grouped matmul per projection (bf16, CUDA 9.0+ or the CPU)
MOE_PREFILL_MODES = ("dense", "grouped")
OPTIONS = {"moe_decode": MOE_DECODE_MODES, "moe_prefill": MOE_PREFILL_MODES}
MARGIN = 0.03


def plan(model: Any, mode: str, device: str, batch: int) -> dict[str, Any]:
    """{"used": "aten" | "kernel", "note", and with auto on CUDA "timings" (µs a step of every MoE layer)}."""
    from trtbuild.models.moe import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return {"used": "aten", "note": "no mixture of experts"}
    if mode == "aten":
        return {"used": "aten", "note": "options.moe_decode is aten"}
    if not device.startswith("cuda"):
        if mode == "kernel":
            raise TrtbuildError("options.moe_decode: 'kernel' cannot serve a CPU build (the kernel is Triton on CUDA); "
                                "use aten or auto")
        return {"used": "aten", "note": "aten: a CPU build"}
    if mode == "kernel":
        return {"used": "kernel", "note": "options.moe_decode is kernel"}
    try:
        timings = measure(layers, batch)
    except Exception as exc:  # a kernel that cannot launch here: ATen's gather is correct everywhere
        return {"used": "aten", "note": f"auto: the kernel failed: {type(exc).__name__}: {exc}"[:300]}
    faster = timings["kernel_us"] < (1 - MARGIN) * timings["aten_us"]
    return {"used": "kernel" if faster else "aten", "timings": timings,
            "note": f"auto: {timings['kernel_us']:.0f} us with the kernel against {timings['aten_us']:.0f} us with "
                    f"ATen's gather at batch {batch} (the kernel only if {MARGIN:.0%} faster)"}


def measure(layers: list[Any], batch: int, reps: int = 20) -> dict[str, float]:
    """Median µs of one pass of `batch` tokens through every MoE layer, each way, replayed from a CUDA graph."""
    import torch

    p = layers[0].w13
    x = torch.randn(1, batch, p.shape[-1], device=p.device, dtype=p.dtype)
    out: dict[str, float] = {}
    for way in ("aten", "kernel"):
        for m in layers:
            m.decode_kernel = way

        def run() -> None:
            for m in layers:
                m(x, lambda t: t, None, gathered=True)

        with torch.no_grad():
            run()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            times = []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graph.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
        out[f"{way}_us"] = statistics.median(times)
    for m in layers:
        m.decode_kernel = "aten"
    return out


def route(model: Any, used: str) -> None:
    """Set every MoE layer's decode path for the exports that follow (prefill graphs run the dense path)."""
    from trtbuild.models.moe import MoE

    for m in model.modules():
        if isinstance(m, MoE):
            m.decode_kernel = used


def prefill_plan(model: Any, mode: str, dtype: Any, device: str) -> dict[str, str]:
    """{"used": "dense" | "grouped", "note"}: a mixture of experts' prompt path (options.moe_prefill)."""
    import torch

    from trtbuild.models.moe import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        return {"used": "dense", "note": "no mixture of experts"}
    if mode == "dense":
        return {"used": "dense", "note": "options.moe_prefill is dense"}
    d, f = layers[0].w2.shape[1], layers[0].w2.shape[2]
    why = None
    if dtype != torch.bfloat16:
        why = "torch._grouped_mm takes bf16 only"
    elif d % 8 or f % 8:
        why = f"torch._grouped_mm needs rows of a multiple of 16 bytes (hidden {d}, expert width {f})"
    elif device.startswith("cuda") and torch.cuda.get_device_capability() < (9, 0):
        why = "torch._grouped_mm needs compute capability 9.0 or later on CUDA"
    if why:
        raise TrtbuildError(f"options.moe_prefill: 'grouped' cannot serve this build: {why}; use dense")
    return {"used": "grouped", "note": "options.moe_prefill is grouped"}


def route_prefill(model: Any, used: str) -> None:
    """Set every MoE layer's prompt path for the exports that follow."""
    from trtbuild.models.moe import MoE

    for m in model.modules():
        if isinstance(m, MoE):
            m.prefill_kernel = used
