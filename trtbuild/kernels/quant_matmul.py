"""The decode matmul for quantized weights: a few rows of bf16 activations against an fp8, int8 or int4
weight, dequantized in registers (models/quantize.py has the formats).

As `decode_matmul.py` for dense weights: each program owns BLOCK_N output columns and streams their rows
of the weight once, so a decode step reads the quantized bytes, not a dequantized copy. fp8 and int8 rows
are widened to the activations' dtype (exact: both fit bf16) and the per-channel scale multiplies the fp32
sums once, after the loop. int4 steps through K several whole groups at a time: one load of the step's
bytes per row gives both nibbles, the low ones for the first half of each group's columns and the high ones
for the second (the split-halves packing), each (q - zero) * scale in fp32 (the group's scale and zero
gathered per byte) and rounded to the activations' dtype as the reference dequantization rounds, then two
dots with the matching columns of x.

Registered as the custom op `trtbuild::quant_matmul`, which the decode graphs of a quantized CUDA engine
call for every quantized Linear (`Linear.decode_config`); the fusions stay outside it. Imported only where
Triton is present; tested through Triton's interpreter on the CPU and compiled on the GPU.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from trtbuild.kernels.grid_dependency import release_successor, wait_for_predecessor, waits_on
from trtbuild.kernels.matmul_configs import MatmulConfig

MAX_ROWS = 16
# Fixed configurations until the build times them: 4 warps stream BLOCK_N rows, BLOCK_K columns a step (int4:
# the most whole groups that fit BLOCK_K and divide K). The shapes of the dense kernel's fastest one-row
# candidates on the H100/H200 (n2k2048, n4k2048: RESULTS.md) in bytes a step; 8 rows and 256 columns (one
# int4 group a step) ran the 1B decode at 3.6x (fp8) and 10x (int4) its floor on an H100.
CONFIGS = {"fp8": MatmulConfig(4, 2048, 4, 2), "int8": MatmulConfig(4, 2048, 4, 2), "int4": MatmulConfig(4, 2048, 4, 2)}


def source_digest() -> str:
    """This file's content: a compiled graph that calls the kernel is reusable only with the same kernel."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


@triton.jit
def _acc_dot(acc, x, w, USE_DOT: tl.constexpr):
    """acc + x @ w^T, w already in x's dtype."""
    if USE_DOT:
        acc += tl.dot(x, tl.trans(w))
    else:
        acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
    return acc


@triton.jit
def _quant_matmul_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INT4: tl.constexpr,
                         GROUP: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    if PDL:
        z = wait_for_predecessor()
        x_ptr, q_ptr, s_ptr, z_ptr, y_ptr = x_ptr + z, q_ptr + z, s_ptr + z, z_ptr + z, y_ptr + z
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    q_rows = q_ptr + offs_n[:, None] * stride_qn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INT4:
        # BLOCK_K columns a step, GROUP (a divisor of BLOCK_K) to a scale: the step's BLOCK_K / 2 bytes of a row
        # are BLOCK_K / GROUP groups' bytes back to back, byte j of group g holding columns g * GROUP + j (low
        # nibble) and g * GROUP + GROUP / 2 + j (high)
        HALF: tl.constexpr = GROUP // 2
        offs_b = tl.arange(0, BLOCK_K // 2)
        grp = offs_b // HALF
        col_lo = offs_b + grp * HALF  # the column of each byte's low nibble within the step
        for k0 in range(0, K, BLOCK_K):
            packed = tl.load(q_rows + k0 // 2 + offs_b[None, :], mask=n_mask[:, None], other=0)
            g_idx = k0 // GROUP + grp[None, :]
            scale = tl.load(s_ptr + offs_n[:, None] * stride_sn + g_idx, mask=n_mask[:, None], other=0.0).to(tl.float32)
            zero = tl.load(z_ptr + offs_n[:, None] * stride_sn + g_idx, mask=n_mask[:, None], other=0.0).to(tl.float32)
            x_lo = tl.load(x_rows + k0 + col_lo[None, :], mask=m_mask[:, None], other=0.0)
            x_hi = tl.load(x_rows + k0 + HALF + col_lo[None, :], mask=m_mask[:, None], other=0.0)
            w_lo = (((packed & 15).to(tl.float32) - zero) * scale).to(x_lo.dtype)
            w_hi = (((packed >> 4).to(tl.float32) - zero) * scale).to(x_lo.dtype)
            acc = _acc_dot(acc, x_lo, w_lo, USE_DOT)
            acc = _acc_dot(acc, x_hi, w_hi, USE_DOT)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            if EVEN_K:
                w_mask = n_mask[:, None]
                x_mask = m_mask[:, None]
            else:
                w_mask = n_mask[:, None] & (k < K)[None, :]
                x_mask = m_mask[:, None] & (k < K)[None, :]
            x = tl.load(x_rows + k[None, :], mask=x_mask, other=0.0)
            # no `other`: an integer fill does not cast to fp8 (Triton's interpreter refuses it); masked lanes
            # are zeroed after the widening instead
            w = tl.where(w_mask, tl.load(q_rows + k[None, :], mask=w_mask).to(x.dtype), 0.0)
            acc = _acc_dot(acc, x, w, USE_DOT)
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if PDL:
        acc = release_successor(acc)
    out_mask = m_mask[:, None] & n_mask[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def _launch(kernel: object, x: Tensor, qweight: Tensor, scale: Tensor, zero: Tensor | None, y: Tensor,
            config: MatmulConfig) -> None:
    m, k = x.shape
    n = qweight.shape[0]
    int4 = zero is not None
    if m > MAX_ROWS or x.stride(1) != 1 or qweight.stride(1) != 1 or qweight.shape[1] * (2 if int4 else 1) != k:
        raise ValueError(f"quant_matmul takes x [<=16, K] and a quantized weight of K columns with contiguous rows, "
                         f"got {tuple(x.shape)}, {tuple(qweight.shape)} {qweight.dtype}")
    group = k // scale.shape[1] if int4 else 0
    dot = m > 1
    # several rows: a tensor-core dot, which takes 16 columns or more, in the dense kernel's multi-row shapes
    # (a 16 x 2048 tile of x and of w would not fit the registers)
    block_n, block_k = (max(16, config.block_n), min(config.block_k, 256)) if dot else (config.block_n, config.block_k)
    # int4: a power of two of whole groups a step (Triton's ranges are powers of two; so are the groups), the
    # most that fit block_k and divide K
    if int4:
        limit, block_k = block_k, group
        while block_k * 2 <= limit and k % (block_k * 2) == 0:
            block_k *= 2
    kernel[(triton.cdiv(n, block_n),)](  # type: ignore[index]
        x, qweight, scale, scale if zero is None else zero, y, m, n, k, x.stride(0), qweight.stride(0),
        scale.stride(0), y.stride(0), BLOCK_M=16 if dot else triton.next_power_of_2(m), BLOCK_N=block_n,
        BLOCK_K=block_k, INT4=int4, GROUP=max(group, 2), USE_DOT=dot, EVEN_K=k % block_k == 0, PDL=waits_on(x.device),
        num_warps=config.warps, num_stages=config.stages)


def quant_matmul(x: Tensor, qweight: Tensor, scale: Tensor, zero: Tensor | None, config: MatmulConfig) -> Tensor:
    """x [M, K] @ dequantize(weight)^T for M <= 16 (eager launch)."""
    y = torch.empty((x.shape[0], qweight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(_quant_matmul_kernel, x, qweight, scale, zero, y, config)
    return y


@triton_op("trtbuild::quant_matmul", mutates_args=())
def quant_matmul_op(x: Tensor, qweight: Tensor, scale: Tensor, zero: Tensor | None, block_n: int, block_k: int,
                    warps: int, stages: int) -> Tensor:
    """The kernel as a custom op: what a quantized engine's decode graphs call (`Linear._kernel`)."""
    y = torch.empty((x.shape[0], qweight.shape[0]), dtype=x.dtype, device=x.device)
    _launch(wrap_triton(_quant_matmul_kernel), x, qweight, scale, zero, y, MatmulConfig(block_n, block_k, warps, stages))
    return y
