"""A Triton matmul for decode: a few rows of activations against one large weight matrix.

Why it exists: in a decode step every weight is read once for 1-8 rows of activations, so a matmul
is a pure stream of its weight matrix. The H200 profiles (benchmarks/RESULTS.md) show cuBLAS's
skinny kernels reading the per-layer matrices (8-235 MB) at 2.8-3.6 TB/s, with split-K reduction
kernels of their own, against a 4.25 TB/s copy rate. This kernel has no split-K: each program owns a
block of output columns and streams its rows of the weight whole, so one launch reads the matrix once.

It is a tactic like any other: at build time (CUDA, tactics above `none`) `select` times cuBLAS and
each candidate launch configuration per weight shape and batch size, over the model's own per-layer
weights inside a CUDA graph (as a decode step runs them), and the decode graphs call this kernel only
for the shapes where it measured faster. Registered as the custom op `trtbuild::decode_matmul`, so
export records it with its configuration and AOTInductor compiles it into the package.

Imported only where Triton and a GPU are present (`triton` is not a dependency of trtbuild). Lives
with the model code because it changes what is built: its source is part of every engine's key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton


@dataclass(frozen=True)
class MatmulConfig:
    """One candidate kernel: the launch shape the probe benchmarks per weight shape."""

    block_n: int
    block_k: int
    warps: int
    stages: int

    @property
    def name(self) -> str:
        return f"n{self.block_n}k{self.block_k}w{self.warps}s{self.stages}"

    @classmethod
    def parse(cls, name: str) -> "MatmulConfig":
        n, rest = name[1:].split("k")
        k, rest = rest.split("w")
        w, s = rest.split("s")
        return cls(int(n), int(k), int(w), int(s))


# Candidates per row count. One row: a multiply-and-sum over BLOCK_N weight rows; several: a tensor-core
# dot with the rows padded to 16 (the padding is masked, never read). Chosen from the H200 probe
# (benchmarks/matmul_probe.py): narrow blocks give the 4096-row matrices enough programs per SM.
ONE_ROW = [MatmulConfig(n, k, w, s) for n in (4, 8, 16, 32) for k in (256, 512, 1024) for w in (4,) for s in (1, 3)] + [
    MatmulConfig(n, 1024, 8, s) for n in (16, 32) for s in (1, 3)]
ROWS = [MatmulConfig(n, k, 4, s) for n in (16, 32, 64) for k in (128, 256, 512) for s in (3, 4)] + [
    MatmulConfig(64, k, 8, s) for k in (256, 512) for s in (3, 4)]


MAX_ROWS = 16  # the dot path pads the rows to 16; a larger batch is a GEMM, cuBLAS's ground


def candidates(rows: int) -> list[MatmulConfig]:
    return ONE_ROW if rows == 1 else ROWS


def source_digest() -> str:
    """This file's content: a compiled graph that calls the kernel is only reusable with the same kernel."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


@triton.jit
def _decode_matmul_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          USE_DOT: tl.constexpr, EVEN_K: tl.constexpr):
    # y[m, n] = sum_k x[m, k] * w[n, k]: w is an nn.Linear weight ([out, in], rows contiguous), so
    # each program reads BLOCK_N whole rows of it, coalesced along k.
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        if EVEN_K:
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None], other=0.0)
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0)
        else:
            k_mask = k < K
            w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if USE_DOT:
            # tensor cores need 16 rows; the padding rows are masked zeros and cost no memory traffic
            acc += tl.dot(x, tl.trans(w))
        else:
            acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def uses_dot(rows: int) -> bool:
    """Tensor-core dot for 2+ rows; one row is a plain multiply-and-sum (a dot would pad it 16x in registers)."""
    return rows > 1


def _launch(kernel: Any, x: Tensor, w: Tensor, y: Tensor, config: MatmulConfig) -> None:
    m, k = x.shape
    n = w.shape[0]
    if m > MAX_ROWS or w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"decode_matmul takes x [<=16, K] and w [N, K] with contiguous rows, got {tuple(x.shape)}, {tuple(w.shape)}")
    dot = uses_dot(m)
    kernel[(triton.cdiv(n, config.block_n),)](
        x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        BLOCK_M=16 if dot else triton.next_power_of_2(m), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        USE_DOT=dot, EVEN_K=k % config.block_k == 0, num_warps=config.warps, num_stages=config.stages)


def decode_matmul(x: Tensor, w: Tensor, config: MatmulConfig, out: Tensor | None = None) -> Tensor:
    """x [M, K] @ w[N, K]^T for M <= 16, written into `out` [M, N] when given (eager launch)."""
    y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device) if out is None else out
    _launch(_decode_matmul_kernel, x, w, y, config)
    return y


@triton_op("trtbuild::decode_matmul", mutates_args=())
def decode_matmul_op(x: Tensor, w: Tensor, block_n: int, block_k: int, warps: int, stages: int) -> Tensor:
    """The kernel as a custom op: what the decode graphs call (`Linear.decode_config`). The config
    ints are literals in the exported program, so two configurations never share a compiled graph."""
    y = torch.empty((x.shape[0], w.shape[0]), dtype=x.dtype, device=x.device)
    _launch(wrap_triton(_decode_matmul_kernel), x, w, y, MatmulConfig(block_n, block_k, warps, stages))
    return y


def graph_seconds(calls: Callable[[], None], reps: int = 15) -> float:
    """Seconds per replay of one CUDA graph holding `calls`: the median of `reps` event-timed replays.

    In a graph, as in the engine's decode, there is no launch overhead between kernels; outside one,
    Python's ~20 us per launch would hide a 2 us matmul."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls()  # compiles and warms outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    return times[len(times) // 2]


def select(weights: Sequence[Tensor], rows: int, reps: int = 15) -> dict[str, Any]:
    """Time cuBLAS and every candidate for `rows` x weight^T over `weights` (all of one shape, e.g.
    every layer's QKV matrix: distinct tensors, so none is served from L2 as in a real step).

    Returns {"choice": "cublas" | config name, "cublas_us", "candidates": {name: us | error}}, per call.
    A candidate whose result differs from cuBLAS's beyond bf16 rounding is refused, never chosen."""
    w0 = weights[0]
    x = torch.randn(rows, w0.shape[1], device=w0.device, dtype=w0.dtype)
    ys = [torch.empty(rows, w0.shape[0], device=w0.device, dtype=w0.dtype) for _ in weights]
    ref = F.linear(x, w0).float()

    def cublas() -> None:
        for w in weights:
            F.linear(x, w)

    per_call = len(weights)
    result: dict[str, Any] = {"cublas_us": graph_seconds(cublas, reps) / per_call * 1e6, "candidates": {}}
    best, best_us = "cublas", result["cublas_us"]
    for config in candidates(rows):
        try:
            y0 = decode_matmul(x, w0, config, out=ys[0])
            err = ((y0.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            if not err <= 2e-2:
                result["candidates"][config.name] = f"refused: max relative error {err:.3g} against cuBLAS"
                continue

            def triton_calls(config: MatmulConfig = config) -> None:
                for w, y in zip(weights, ys):
                    decode_matmul(x, w, config, out=y)

            us = graph_seconds(triton_calls, reps) / per_call * 1e6
        except Exception as e:  # a configuration that does not compile here is a measurement too
            result["candidates"][config.name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            continue
        result["candidates"][config.name] = us
        if us < best_us:
            best, best_us = config.name, us
    result["choice"] = best
    return result


def fastest_kernel(result: dict[str, Any]) -> str | None:
    """The fastest configuration that ran correctly in a `select` result, whether or not it beat cuBLAS."""
    timed = {name: us for name, us in result["candidates"].items() if isinstance(us, float)}
    return min(timed, key=timed.__getitem__) if timed else None
