"""A Triton matmul for decode: a few rows of activations against one large weight matrix.

Why it exists: in a decode step every weight is read once for 1-8 rows of activations, so a matmul
is a pure stream of its weight matrix. The H200 profiles (benchmarks/RESULTS.md) show cuBLAS's
skinny kernels reading the per-layer matrices (8-235 MB) at 2.8-3.6 TB/s, with split-K reduction
kernels of their own, against a 4.25 TB/s copy rate. Each program owns a block of output columns and
streams its rows of the weight, so one launch reads the matrix once. Split-K candidates (`split` > 1,
the plain matmul only) also divide the rows' length among `split` programs, which write fp32 partial
sums that a second, small kernel adds up: more programs for a short, wide matrix (the 1B down
projection, 2048 x 8192, had 256 programs of 8 columns for 132 SMs), at the cost of one more launch.

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
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from trtbuild.kernels.grid_dependency import release_successor, wait_for_predecessor, waits_on
from trtbuild.kernels.grid_dependency import source_digest as wait_digest
from trtbuild.kernels import blocks, fusions
from trtbuild.kernels.blocks import REDUCE_BLOCK, dot_acc, _split_reduce_kernel
from trtbuild.kernels.fusions import FUSIONS, GAINED, GATED, NORMED  # noqa: F401 (FUSIONS: the names callers use)
from trtbuild.kernels.matmul_configs import MatmulConfig, candidates
from trtbuild.timing import graph_seconds

MAX_ROWS = 16  # the dot path pads the rows to 16; a larger batch is a GEMM, cuBLAS's ground


def source_digest() -> str:
    """This file's content, its wait's and the shared blocks': a compiled graph that calls the kernel is only
    reusable with the same kernel."""
    return hashlib.sha256(Path(__file__).read_bytes() + Path(fusions.__file__).read_bytes()
                          + wait_digest().encode() + blocks.source_digest().encode()).hexdigest()[:16]




@triton.jit
def _normed(x, squares, g_ptr, k, K, NORM: tl.constexpr, GAIN: tl.constexpr, USE_DOT: tl.constexpr):
    """x for one BLOCK_K step, and the running squares of its elements. With NORM, RMSNorm folded in: its
    1/rms (a per-row scalar, known only after the whole row) scales the sums at the end (`_row_sums`);
    with GAIN the norm's weight also scales x here (without, it is already folded into w). Every
    program reads all of x anyway.
    The squares are kept in the layouts the matmul already gives x, and summed once after the loop: on
    the one-row path per element, [1, 1, BLOCK_K] as x is broadcast against w (a sum over k every step,
    or a 2-D accumulator, measured on the H200 at +1-8 us a call against the plain kernel: cross-thread
    reductions and layout conversions each step); on the tensor-core path as x @ x^T, [16, 16], whose
    diagonal is each row's sum of squares (a second small dot on the operand already loaded)."""
    if NORM:
        if USE_DOT:
            squares = tl.dot(x, tl.trans(x), squares)
        else:
            xb = x[:, None, :].to(tl.float32)
            squares += xb * xb
        if GAIN:
            g = tl.load(g_ptr + k, mask=k < K, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) * g[None, :]).to(x.dtype)
    return x, squares


@triton.jit
def _row_sums(squares, BLOCK_M: tl.constexpr, USE_DOT: tl.constexpr):
    """Each row's sum of squares, [BLOCK_M], from what `_normed` accumulated."""
    if USE_DOT:
        rows = tl.arange(0, BLOCK_M)
        return tl.sum(tl.where(rows[:, None] == rows[None, :], squares, 0.0), axis=1)
    else:
        return tl.sum(tl.sum(squares, axis=2), axis=1)


@triton.jit
def _decode_matmul_kernel(x_ptr, w_ptr, y_ptr, g_ptr, r_ptr, M, N, K, stride_xm, stride_wn, stride_ym, stride_rm,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, NORM: tl.constexpr, GAIN: tl.constexpr,
                          EPS: tl.constexpr,
                          GATE: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                          SPLIT: tl.constexpr, K_SLICE: tl.constexpr):
    # y[m, n] = sum_k x[m, k] * w[n, k]: w is an nn.Linear weight ([out, in], rows contiguous), so
    # each program reads BLOCK_N whole rows of it, coalesced along k. With GATE it reads rows n and
    # N + n (gate and up) and writes silu(gate) * up: N is then half of w's rows. With SPLIT > 1,
    # program (i, j) reads columns [j * K_SLICE, (j + 1) * K_SLICE) of k and writes its fp32 partial
    # sums to rows j * M .. j * M + M - 1 of y (a workspace), which _split_reduce_kernel adds up.
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    if PDL:
        # programmatic dependent launch (grid_dependency.py): this kernel's blocks may be scheduled before the
        # previous kernel completes; every address depends on the wait. (Loading the first weight tile before
        # the wait, which no kernel of a step writes, was measured on the H200: no gain at batch 1, 0.12 ms
        # slower a 1B step at batch 8; RESULTS.md. Removed.)
        z = wait_for_predecessor()
        x_ptr, w_ptr, y_ptr, g_ptr, r_ptr = x_ptr + z, w_ptr + z, y_ptr + z, g_ptr + z, r_ptr + z
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    u_rows = w_ptr + (offs_n + N)[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if not NORM:
        squares = tl.zeros((BLOCK_M,), dtype=tl.float32)  # unused
    elif USE_DOT:
        squares = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
    else:
        squares = tl.zeros((BLOCK_M, 1, BLOCK_K), dtype=tl.float32)
    k_lo = 0
    k_hi = K
    if SPLIT > 1:  # K_SLICE is a multiple of BLOCK_K; the last slices may be short or empty (zeros written)
        k_lo = tl.program_id(1) * K_SLICE
        k_hi = tl.minimum(k_lo + K_SLICE, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        if EVEN_K:
            w_mask = n_mask[:, None]
            x_mask = m_mask[:, None]
        else:
            w_mask = n_mask[:, None] & (k < K)[None, :]
            x_mask = m_mask[:, None] & (k < K)[None, :]
        w = tl.load(w_rows + k[None, :], mask=w_mask, other=0.0)
        x, squares = _normed(tl.load(x_rows + k[None, :], mask=x_mask, other=0.0), squares, g_ptr, k, K, NORM, GAIN,
                             USE_DOT)
        acc = dot_acc(acc, x, w, USE_DOT)
        if GATE:
            acc_up = dot_acc(acc_up, x, tl.load(u_rows + k[None, :], mask=w_mask, other=0.0), USE_DOT)
    if NORM:
        inv_rms = 1.0 / tl.sqrt(_row_sums(squares, BLOCK_M, USE_DOT) / K + EPS)
        acc = acc * inv_rms[:, None]
        acc_up = acc_up * inv_rms[:, None]
    if GATE:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    out_mask = m_mask[:, None] & n_mask[None, :]
    if RESIDUAL:
        acc += tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=out_mask, other=0.0).to(tl.float32)
    if PDL:  # the weights are read: the next kernel may be scheduled (it waits for this one to complete)
        acc = release_successor(acc)
    if SPLIT > 1:
        offs_m += tl.program_id(1) * M
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def uses_dot(rows: int) -> bool:
    """Tensor-core dot for 2+ rows; one row is a plain multiply-and-sum (a dot would pad it 16x in registers)."""
    return rows > 1


def _launch(kernel: Any, x: Tensor, w: Tensor, y: Tensor, config: MatmulConfig, norm: Tensor | None = None,
            eps: float = 0.0, gate: bool = False, residual: Tensor | None = None, rms: bool = False,
            reduce: Any = lambda k: k) -> None:
    """Launch `kernel` (the matmul, wrapped or not) and, for split-K, `reduce(_split_reduce_kernel)` after it:
    the custom op wraps both for AOTInductor. x is normalized by its rms when `norm` (the norm's gain) is
    given or `rms` is set (the gain folded into w)."""
    rms = rms or norm is not None
    m, k = x.shape
    n = y.shape[1]
    if m > MAX_ROWS or w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1 or w.shape[0] != n * (2 if gate else 1):
        raise ValueError(f"decode_matmul takes x [<=16, K] and w [N, K] (or [2N, K] gated) with contiguous rows, "
                         f"got {tuple(x.shape)}, {tuple(w.shape)}")
    if residual is not None and (residual.shape != y.shape or residual.stride(1) != 1):
        raise ValueError(f"decode_matmul's residual must be [M, N] with contiguous rows, got {tuple(residual.shape)}")
    split = config.split
    if split > 1 and (rms or gate or residual is not None):
        raise ValueError(f"decode_matmul: split-K ({config.name}) does the plain matmul only")
    if split > 1 and y.stride(0) != n:
        raise ValueError(f"decode_matmul: split-K writes a contiguous output, got strides {y.stride()}")
    dot = uses_dot(m)
    pdl = waits_on(x.device)
    # the partial sums' rows: [split * M, N] fp32, every element written (empty slices write zeros)
    target = y if split == 1 else torch.empty((split * m, n), dtype=torch.float32, device=x.device)
    k_slice = triton.cdiv(triton.cdiv(k, split), config.block_k) * config.block_k
    # absent operands still need a pointer: w stands in, and the constexpr flags keep it unread
    kernel[(triton.cdiv(n, config.block_n), split)](
        x, w, target, w if norm is None else norm, w if residual is None else residual, m, n, k,
        x.stride(0), w.stride(0), target.stride(0), 0 if residual is None else residual.stride(0),
        BLOCK_M=16 if dot else triton.next_power_of_2(m), BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        USE_DOT=dot, EVEN_K=k % config.block_k == 0, NORM=rms, GAIN=norm is not None, EPS=float(eps),
        GATE=gate,
        RESIDUAL=residual is not None, PDL=pdl, SPLIT=split, K_SLICE=k_slice if split > 1 else 0,
        num_warps=config.warps, num_stages=config.stages)
    if split > 1:
        reduce(_split_reduce_kernel)[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            target, y, m * n, SPLIT=split, BLOCK=REDUCE_BLOCK, PDL=pdl, num_warps=4)


def output_columns(w: Tensor, gate: bool) -> int:
    return w.shape[0] // 2 if gate else w.shape[0]


def decode_matmul(x: Tensor, w: Tensor, config: MatmulConfig, out: Tensor | None = None, norm: Tensor | None = None,
                  eps: float = 0.0, gate: bool = False, residual: Tensor | None = None, rms: bool = False) -> Tensor:
    """x [M, K] @ w[N, K]^T for M <= 16, with the fusions above, written into `out` when given (eager launch)."""
    y = torch.empty((x.shape[0], output_columns(w, gate)), dtype=x.dtype, device=x.device) if out is None else out
    _launch(_decode_matmul_kernel, x, w, y, config, norm, eps, gate, residual, rms)
    return y


@triton_op("trtbuild::decode_matmul", mutates_args=())
def decode_matmul_op(x: Tensor, w: Tensor, norm: Tensor | None, residual: Tensor | None, eps: float, gate: bool,
                     block_n: int, block_k: int, warps: int, stages: int, split: int = 1, rms: bool = False) -> Tensor:
    """The kernel as a custom op: what the decode graphs call (`Linear.decode_config`). The config ints, eps
    and gate are literals in the exported program, so two configurations never share a compiled graph.
    (eps reaches the kernel as a compile-time constant: AOTInductor passes a float argument of a user
    kernel as fp64, which would promote the normalization to fp64.) `rms`: normalize x without a gain
    (`norm` None), the gain being folded into w."""
    y = torch.empty((x.shape[0], output_columns(w, gate)), dtype=x.dtype, device=x.device)
    _launch(wrap_triton(_decode_matmul_kernel), x, w, y, MatmulConfig(block_n, block_k, warps, stages, split),
            norm, eps, gate, residual, rms, reduce=wrap_triton)
    return y


def reference(x: Tensor, w: Tensor, fusion: str, norm: Tensor | None = None, eps: float = 0.0,
              residual: Tensor | None = None) -> Tensor:
    """What the kernel computes for `fusion` (`norm` given for the normed fusions: for rms and rms_gate
    the ones a folded norm keeps; `residual` for residual), in ATen ops the way the model computes it."""
    if norm is not None:
        xf = x.float()
        x = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * norm
    y = F.linear(x, w)
    if fusion in GATED:
        a, b = y.chunk(2, dim=-1)
        y = F.silu(a) * b
    return y if residual is None else residual + y


def select(weights: Sequence[Tensor], rows: int, fusion: str = "none", reps: int = 15,
           split: bool = False, configs: Sequence[MatmulConfig] | None = None) -> dict[str, Any]:
    """Time cuBLAS and every candidate for `rows` x weight^T over `weights` (all of one shape, e.g.
    every layer's QKV matrix: distinct tensors, so none is served from L2 as in a real step).

    The candidates run with `fusion` (what the decode graph will ask of them). What they replace is
    timed the way the graph would run it without them: for a fused call site, `reference` (the norm,
    the cuBLAS matmul, the gating or the add) compiled by Inductor, as `unfused_us`; for a plain one,
    cuBLAS alone. Returns {"choice": "cublas" | config name, "cublas_us", ["unfused_us",] "fusion",
    "candidates": {name: us | error}}, per call; `configs` replaces the full candidate list. A candidate
    whose result differs from the ATen reference beyond bf16 rounding is refused, never chosen."""
    w0 = weights[0]
    x = torch.randn(rows, w0.shape[1], device=w0.device, dtype=w0.dtype)
    # a folded norm's gain is ones: the model still multiplies by it outside the kernel, the kernel reads none
    norm = (torch.rand(w0.shape[1], device=w0.device, dtype=w0.dtype) + 0.5 if fusion in GAINED else
            torch.ones(w0.shape[1], device=w0.device, dtype=w0.dtype) if fusion in NORMED else None)
    width = output_columns(w0, fusion in GATED)
    residual = torch.randn(rows, width, device=w0.device, dtype=w0.dtype) if fusion == "residual" else None
    ys = [torch.empty(rows, width, device=w0.device, dtype=w0.dtype) for _ in weights]
    ref = reference(x, w0, fusion, norm, 1e-5, residual).float()

    def launch(w: Tensor, y: Tensor, config: MatmulConfig) -> Tensor:
        return decode_matmul(x, w, config, out=y, norm=norm if fusion in GAINED else None, eps=1e-5,
                             gate=fusion in GATED, residual=residual, rms=fusion in NORMED)

    def cublas() -> None:
        for w in weights:
            F.linear(x, w)

    per_call = len(weights)
    t = time.perf_counter()
    result: dict[str, Any] = {"cublas_us": graph_seconds(cublas, reps) / per_call * 1e6, "fusion": fusion,
                              "candidates": {}}
    best, best_us = "cublas", result["cublas_us"]
    if fusion != "none":
        # Inductor compiles each shape once (dynamic=False): a build selects up to 5 per batch bucket
        try:
            with torch._dynamo.config.patch(recompile_limit=256):
                unfused = torch.compile(reference, dynamic=False, fullgraph=True)

                def inductor() -> None:
                    for w in weights:
                        unfused(x, w, fusion, norm, 1e-5, residual)

                result["unfused_us"] = best_us = graph_seconds(inductor, reps) / per_call * 1e6
        except Exception as e:  # then the fused kernel must beat cuBLAS's matmul alone
            result["unfused_us"] = _failure(e)
    # where a selection's seconds go: cuBLAS and the unfused reference (its torch.compile included), then the
    # candidates (each one's load, its check against ATen and its timing)
    seconds = {"references_s": time.perf_counter() - t}
    t = time.perf_counter()
    for config in configs if configs is not None else candidates(rows, fusion, split, w0.shape[1], w0.shape[0]):
        try:
            y0 = launch(w0, ys[0], config)
            err = ((y0.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            if not err <= 2e-2:
                result["candidates"][config.name] = f"refused: max relative error {err:.3g} against ATen"
                continue

            def triton_calls(config: MatmulConfig = config) -> None:
                for w, y in zip(weights, ys, strict=True):
                    launch(w, y, config)

            us = graph_seconds(triton_calls, reps) / per_call * 1e6
        except Exception as e:  # a configuration that does not compile here is a measurement too
            result["candidates"][config.name] = _failure(e)
            continue
        result["candidates"][config.name] = us
        if us < best_us:
            best, best_us = config.name, us
    result["choice"] = best
    result["seconds"] = seconds | {"candidates_s": time.perf_counter() - t}
    return result


def _failure(e: Exception) -> str:
    """A timing that could not be taken, as the selection records it: the error's type and first line."""
    first = str(e).splitlines()[0][:120] if str(e) else ""
    return f"failed: {type(e).__name__}: {first}"
