"""GPTQ's column loop for one block of columns, per output channel (fp8 or int8), as one Triton launch.

Why it exists: GPTQ rounds a weight's columns one after another, each column's rounding error spread over the
columns after it, so the loop is sequential in the columns. Written in torch it is about ten small launches a
column; an 8B model has 852k columns in its Linears, and its fp8 build spent 142 s of 225 s there on an H100
(benchmarks/RESULTS.md), the GPU idle between launches. The rows, though, are independent (a row's scale is
fixed before the loop, and the error of row r moves only row r), so one program takes a band of rows and
carries all of the block's columns in registers through the whole loop: one launch a block of 128 columns.

It does what `gptq.gptq_channel`'s torch loop does, in the same order and with the same roundings (IEEE
division, no contracted multiply-adds). The grid rounding is written out in arithmetic (round half to even by
the 1.5 * 2^23 addition; fp8 e4m3's grid step taken from the exponent bits), not the hardware's fp8
conversion, so the interpreter on a CPU computes what the GPU does: the tests compare codes with the torch
loop's bit for bit there. Compiled for sm_90 on a CPU (Triton 3.6), it takes 145 registers a thread, no stack.

Imported only where Triton and a GPU are present (`triton` is not a dependency of trtbuild).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

ROWS = 16  # rows a program: its three 128-column tiles stay in registers (145 a thread for sm_90; 32 rows took 247)
MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: x + MAGIC - MAGIC rounds |x| < 2^22 to the nearest integer, ties to even


@triton.jit
def _round_even(x):
    return (x + MAGIC) - MAGIC


@triton.jit
def _fp8_grid(x):
    """x (|x| <= 448) to the nearest float8 e4m3 value, ties to even: a grid of 2^(e - 3) between 2^e and
    2^(e+1), its spacing 2^-9 below 2^-6 (the subnormals)."""
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.maximum(e, -6)
    step = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - (e - 3)) << 23).to(tl.float32, bitcast=True)  # powers of two: both products exact
    return _round_even(x * inverse) * step


@triton.jit
def _channel_block_kernel(w_ptr, h_ptr, s_ptr, q_ptr, e_ptr, n, b, stride_wr, stride_wc, stride_hr, stride_hc,
                          stride_q, stride_e,
                          TOP: tl.constexpr, FP8: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_B)
    rmask, cmask = rows < n, cols < b
    mask = rmask[:, None] & cmask[None, :]
    w = tl.load(w_ptr + rows[:, None] * stride_wr + cols[None, :] * stride_wc, mask=mask, other=0.0)
    scale = tl.load(s_ptr + rows, mask=rmask, other=1.0)
    codes = tl.zeros([BLOCK_R, BLOCK_B], tl.float32)
    errors = tl.zeros([BLOCK_R, BLOCK_B], tl.float32)
    for i in range(0, b):
        this = cols[None, :] == i
        col = tl.sum(tl.where(this, w, 0.0), axis=1)  # the column as the errors before it left it
        x = tl.minimum(tl.maximum(tl.math.div_rn(col, scale), -TOP), TOP)
        q = _fp8_grid(x) if FP8 else _round_even(x)
        err = tl.math.div_rn(col - q * scale, tl.load(h_ptr + i * (stride_hr + stride_hc)))
        # Hinv is upper triangular: the row is zero left of i, so the columns already rounded keep their values
        h = tl.load(h_ptr + i * stride_hr + cols * stride_hc, mask=cmask, other=0.0)
        w = w - err[:, None] * h[None, :]
        codes = tl.where(this, q[:, None], codes)
        errors = tl.where(this, err[:, None], errors)
    tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], codes, mask=mask)
    tl.store(e_ptr + rows[:, None] * stride_e + cols[None, :], errors, mask=mask)


def channel_block(w: Tensor, hinv: Tensor, scale: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """One block's columns of `w` (N, B fp32, B <= 128; any strides, so a view of the whole weight will do)
    rounded in turn to `fmt` ('fp8' or 'int8') in units of each row's `scale` (N,), each column's error divided
    by its diagonal entry of `hinv` (B, B: the block's part of the upper Cholesky factor of H^-1, which torch
    returns column-major) and spread over the columns after it: (codes, errors), both (N, B) fp32, codes in
    units of the scale. `w` is left as it was."""
    n, b = w.shape
    codes = torch.empty(n, b, dtype=torch.float32, device=w.device)
    errors = torch.empty_like(codes)
    top = 448.0 if fmt == "fp8" else 127.0
    _channel_block_kernel[(triton.cdiv(n, ROWS),)](
        w, hinv, scale, codes, errors, n, b, *w.stride(), *hinv.stride(), codes.stride(0), errors.stride(0),
        TOP=top, FP8=fmt == "fp8", BLOCK_R=ROWS, BLOCK_B=triton.next_power_of_2(b), num_warps=4,
        enable_fp_fusion=False)  # no contracted multiply-adds: each product rounded, as the torch loop's
    return codes, errors
