"""A Triton matmul for decode: a few rows of activations against one large weight matrix.

Why it exists: in a decode step every weight is read once for 1-8 rows of activations, so a matmul
is a pure stream of its weight matrix. The H200 profiles (benchmarks/RESULTS.md) show cuBLAS's
skinny kernels reading the per-layer matrices (8-235 MB) at 2.8-3.6 TB/s, with split-K reduction
kernels of their own, against a 4.25 TB/s copy rate. This kernel has no split-K: each program owns a
block of output columns and streams its rows of the weight whole, so one launch reads the matrix once.

Imported only where Triton and a GPU are present (`triton` is not a dependency of trtbuild).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor


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


def decode_matmul(x: Tensor, w: Tensor, config: MatmulConfig, out: Tensor | None = None) -> Tensor:
    """x [M, K] @ w[N, K]^T for M <= 16, written into `out` [M, N] when given."""
    m, k = x.shape
    n = w.shape[0]
    if m > 16 or w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"decode_matmul takes x [<=16, K] and w [N, K] with contiguous rows, got {tuple(x.shape)}, {tuple(w.shape)}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    dot = uses_dot(m)
    block_m = 16 if dot else triton.next_power_of_2(m)
    grid = (triton.cdiv(n, config.block_n),)
    _decode_matmul_kernel[grid](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
                                BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
                                USE_DOT=dot, EVEN_K=k % config.block_k == 0,
                                num_warps=config.warps, num_stages=config.stages)
    return y
