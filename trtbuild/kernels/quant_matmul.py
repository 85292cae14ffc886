"""The decode matmul for quantized weights: a few rows of bf16 activations against an fp8, int8 or int4
weight, dequantized in registers (models/quantize.py has the formats).

As `decode_matmul.py` for dense weights: each program owns BLOCK_N output columns and streams their rows
of the weight once, so a decode step reads the quantized bytes, not a dequantized copy; with split-K
(`split` > 1) `split` programs share a block of columns, each a slice of k, writing fp32 partial sums that
the shared reduction (`blocks.py`) adds up, so that a short, wide matrix still gives every SM programs.

fp8 and int8 rows are widened by a plain cast (to fp32 on the one-row path, to the activations' dtype for
the tensor cores; exact: both fit bf16) and the per-channel scale multiplies the fp32 sums once, after the
loop.

int4 reads the stored layout as it is: it is already the order the kernel loads (quantize.py's "split
halves": byte j of a group holds columns j and j + G/2), so a step of BLOCK_K columns is one contiguous
BLOCK_K/2-byte load per row, whose low nibbles meet one set of x's columns and whose high nibbles another;
no repacking. The nibbles become numbers with
no int-to-float conversion (a quarter-rate instruction on the GPU, which would cap the kernel below the
memory's rate): a nibble q shifted into the mantissa of 1.0 (bits 19-22 of 0x3F800000) is the fp32
1 + q/16, exactly, with a shift and a mask-and-or, and (q - z) s = (1 + q/16) 16s - (16 + z) s is then
one multiply-add. Each group's scale and zero are loaded once per weight row and broadcast over its bytes (the
step's bytes seen as [rows, groups, bytes of a group]), so every weight is dequantized once with no gather. One
row adds the products lane by lane into a tile summed across threads once, after the loop; several rows round
the dequantized weights to the activations' dtype and take the tensor cores. (Earlier forms gathered a scale
and zero beside every byte and summed across threads every step: 9.5-17x the bytes floor at batch 1 on an
H100, 2.1-5.4x in this form, 2026-12-06; summing each group apart was slower still. Several rows took the
tensor cores a group at a time, the dequantization factored out of each group's dot.) One row's fp32 sum does
not round each weight to bf16 as the reference dequantization does: a difference within bf16's rounding of
the result.

Registered as the custom op `trtbuild::quant_matmul`, which the decode graphs of a quantized CUDA engine
call for every quantized Linear (`Linear.decode_config`); the configuration is timed per format, weight
shape, epilogue and batch at build time (`select`, candidates in matmul_configs.py). Like the dense kernel
under options.decode_fusion epilogue, it does what follows the matmul at its call site: the SiLU gating of
gate/up (`gate`: the program reads rows n and N + n with their scales) and the residual add (`residual`),
which would otherwise be Inductor kernels of their own, three launches a layer; with split-K the reduction
kernel does them (`_split_reduce_epilogue_kernel`). The norm before it stays outside.
Imported only where Triton is present; tested through Triton's interpreter on the CPU and compiled on the GPU.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from trtbuild.kernels import blocks
from trtbuild.kernels.blocks import REDUCE_BLOCK, dot_acc
from trtbuild.kernels.grid_dependency import release_successor, wait_for_predecessor, waits_on
from trtbuild.kernels.grid_dependency import source_digest as wait_digest
from trtbuild.kernels.matmul_configs import MAX_GROUPS_A_STEP, H100_SMS, MatmulConfig, quant_candidates
from trtbuild.timing import graph_seconds

MAX_ROWS = 16
# What a build uses where it times nothing (tactics level none, options.decode_matmul cublas): one per format.
# The dense kernel's fastest one-row shape on the H100 (RESULTS.md) in bytes a step; on 2+ rows the launcher
# widens the block of columns to the tensor cores' 16 and, for fp8 and int8, shortens the step to 512 columns.
CONFIGS = {"fp8": MatmulConfig(4, 2048, 4, 1), "int8": MatmulConfig(4, 2048, 4, 1), "int4": MatmulConfig(4, 2048, 4, 1)}
# the relative error against the dequantized matmul beyond which the selection refuses a candidate
TOLERANCE = 2e-2


def source_digest() -> str:
    """This file's content and that of the Triton code it calls: a compiled graph (or a timing) of the kernel is
    reusable only with the same kernel."""
    return hashlib.sha256(Path(__file__).read_bytes() + blocks.source_digest().encode()
                          + wait_digest().encode()).hexdigest()[:16]


@triton.jit
def _int4_nibbles(packed, ASM: tl.constexpr):
    """A step's packed int4 bytes (int8, [.., bytes]) as fp32 1 + q/16: (low nibbles', high nibbles'). With ASM
    four bytes at a time from the register that holds them (inline PTX): two instructions a weight. Without,
    each byte is first taken into a register of its own, as the compiler does for an int8 widened to int32 (the
    machine code reads three a weight); Triton's interpreter, which runs no PTX, takes this path."""
    if ASM:
        # $8 holds four bytes; $0-$3 get bytes 0-3's low nibbles, $4-$7 their high ones: each shifted into bits
        # 19-22 (byte i's low nibble by 19 - 8i, its high one by 15 - 8i; shr for a negative shift), then
        # lop3 0xEA = (t & 0x780000) | 0x3F800000, 1.0's exponent OR-ed in. One line: AOTInductor writes the
        # kernel's source into a file, where a line break in the string would break it.
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; "
            "shl.b32 t, $8, 19; lop3.b32 $0, t, 0x780000, 0x3F800000, 0xEA; "
            "shl.b32 t, $8, 11; lop3.b32 $1, t, 0x780000, 0x3F800000, 0xEA; "
            "shl.b32 t, $8, 3; lop3.b32 $2, t, 0x780000, 0x3F800000, 0xEA; "
            "shr.b32 t, $8, 5; lop3.b32 $3, t, 0x780000, 0x3F800000, 0xEA; "
            "shl.b32 t, $8, 15; lop3.b32 $4, t, 0x780000, 0x3F800000, 0xEA; "
            "shl.b32 t, $8, 7; lop3.b32 $5, t, 0x780000, 0x3F800000, 0xEA; "
            "shr.b32 t, $8, 1; lop3.b32 $6, t, 0x780000, 0x3F800000, 0xEA; "
            "shr.b32 t, $8, 9; lop3.b32 $7, t, 0x780000, 0x3F800000, 0xEA; "
            "}",
            "=r,=r,=r,=r,=r,=r,=r,=r,r", [packed], dtype=(tl.int32, tl.int32), is_pure=True, pack=4)
    else:
        wide = packed.to(tl.int32)
        # the low nibble shifted to bits 19-22 (by 19), the high one (by 15)
        lo = ((wide << 19) & 0x780000) | 0x3F800000
        hi = ((wide << 15) & 0x780000) | 0x3F800000
    return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)


@triton.jit
def _int4_weights(q3, s_ptr, z_ptr, s3, k0, g_mask, GROUP: tl.constexpr, ASM: tl.constexpr):
    """One step's int4 weights of a block of rows, dequantized to fp32: (low nibbles' columns, high nibbles'),
    each [BLOCK_N, NG groups, GROUP / 2]. `q3` addresses the step's bytes of each row, `s3` each row's groups."""
    packed = tl.load(q3 + k0 // 2, mask=g_mask[:, :, None], other=0)
    scale = tl.load(s_ptr + s3 + k0 // GROUP, mask=g_mask, other=0.0).to(tl.float32)
    zero = tl.load(z_ptr + s3 + k0 // GROUP, mask=g_mask, other=0.0).to(tl.float32)
    # (q - z) s = (1 + q/16) * 16 s - (16 + z) s: one multiply-add a weight after the bit trick
    mul = (16.0 * scale)[:, :, None]
    add = (-(16.0 + zero) * scale)[:, :, None]
    f_lo, f_hi = _int4_nibbles(packed, ASM)
    # an explicit fma: written `f * mul + add`, the compiler contracted add's own product into each weight's
    # multiply-add instead, a multiply and a multiply-add a weight
    return tl.fma(f_lo, mul, add), tl.fma(f_hi, mul, add)


@triton.jit
def _x_halves(x_ptr, col, k0, live, offs_h, BLOCK_N: tl.constexpr, GROUP: tl.constexpr):
    """One row of x for one int4 step, as fp32 (the columns of the step's low nibbles, and of its high ones),
    each [BLOCK_N, NG, GROUP / 2]: loaded at the weights' full shape, not [NG, GROUP / 2] broadcast, so that it
    is loaded in the weights' layout. Loaded at the smaller shape, the compiler chose another layout for it and
    moved it into the weights' through shared memory, with three barriers a step (seen in the compiled
    code for the H100, Triton 3.6); repeating the row's loads for each weight row costs only cache hits."""
    HALF: tl.constexpr = GROUP // 2
    NG: tl.constexpr = col.shape[0]
    # live: [NG], the step's groups that are in k
    x_mask = tl.broadcast_to((live[:, None] & (offs_h < HALF)[None, :])[None, :, :], (BLOCK_N, NG, HALF))
    x_at = x_ptr + k0 + tl.broadcast_to(col[None, :, :], (BLOCK_N, NG, HALF))
    return (tl.load(x_at, mask=x_mask, other=0.0).to(tl.float32),
            tl.load(x_at + HALF, mask=x_mask, other=0.0).to(tl.float32))


@triton.jit
def _quant_matmul_kernel(x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, r_ptr, M, N, K, K_SLICE, stride_xm, stride_qn, stride_sn,
                         stride_ym, stride_rm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         INT4: tl.constexpr, GROUP: tl.constexpr, USE_DOT: tl.constexpr, EVEN_K: tl.constexpr,
                         GATE: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr,
                         ASM: tl.constexpr):
    # y[m, n] = sum_k x[m, k] * w[n, k]. Program (i, j) owns columns i * BLOCK_N.. of y and reads k from
    # j * K_SLICE to (j + 1) * K_SLICE (all of k without split-K; K_SLICE is then K). With SPLIT > 1 it writes
    # its fp32 partial sums to rows j * M .. j * M + M - 1 of y (a workspace), which the reduction adds up.
    # K_SLICE is a run-time argument: one compiled kernel serves every weight width.
    # With GATE the weight holds gate and up ([2N, K]): the program also reads rows N + n, with their scales,
    # and writes silu(gate) * up; with RESIDUAL it adds r[m, n] to the result (with split-K the reduction does both).
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    if PDL:
        z = wait_for_predecessor()
        x_ptr, q_ptr, s_ptr, z_ptr, y_ptr, r_ptr = x_ptr + z, q_ptr + z, s_ptr + z, z_ptr + z, y_ptr + z, r_ptr + z
    k_start = tl.program_id(1) * K_SLICE
    k_end = tl.minimum(K, k_start + K_SLICE)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    q_rows = q_ptr + offs_n[:, None] * stride_qn
    u_rows = q_ptr + (offs_n + N)[:, None] * stride_qn  # the up half's rows (GATE)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if INT4:
        # A step of BLOCK_K columns is one load of its BLOCK_K / 2 bytes a weight row, seen as [BLOCK_N, NG groups,
        # GROUP / 2 bytes]: byte j of group g holds columns g * GROUP + j (low nibble) and g * GROUP + GROUP / 2 + j
        # (high). Each group's scale and zero are loaded once per weight row ([BLOCK_N, NG]) and broadcast over its
        # bytes; every weight is dequantized once, whatever the rows.
        HALF: tl.constexpr = GROUP // 2
        NG: tl.constexpr = BLOCK_K // GROUP
        offs_g = tl.arange(0, NG)
        offs_h = tl.arange(0, HALF)
        byte = offs_g[:, None] * HALF + offs_h[None, :]  # [NG, HALF]: the byte within the step
        col = offs_g[:, None] * GROUP + offs_h[None, :]  # [NG, HALF]: its low nibble's column within the step
        q3 = q_ptr + offs_n[:, None, None] * stride_qn + byte[None, :, :]
        s3 = offs_n[:, None] * stride_sn + offs_g[None, :]  # [BLOCK_N, NG]
        # the same columns flattened, for the rows of x that the tensor cores take
        offs_b = tl.arange(0, BLOCK_K // 2)
        col_b = offs_b // HALF * GROUP + offs_b % HALF
        tile = tl.zeros((BLOCK_N, NG, HALF), dtype=tl.float32)
        tile_up = tl.zeros((BLOCK_N, NG, HALF), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            # K is whole groups and k_end a group boundary, so a group is in or out
            live = (k0 + offs_g * GROUP) < k_end  # [NG]
            g_mask = n_mask[:, None] & live[None, :]
            w_lo, w_hi = _int4_weights(q3, s_ptr, z_ptr, s3, k0, g_mask, GROUP, ASM)
            if GATE:
                u_lo, u_hi = _int4_weights(q3 + N * stride_qn, s_ptr, z_ptr, s3 + N * stride_sn, k0, g_mask, GROUP, ASM)
            if USE_DOT:
                # Several rows: the dequantized weights, rounded to x's dtype as the reference rounds them, into
                # the tensor cores, the step's low nibbles' columns in one dot and the high ones' in another
                x_mask = m_mask[:, None] & ((k0 + offs_b // HALF * GROUP) < k_end)[None, :]
                x_lo = tl.load(x_rows + k0 + col_b[None, :], mask=x_mask, other=0.0)
                x_hi = tl.load(x_rows + k0 + HALF + col_b[None, :], mask=x_mask, other=0.0)
                acc += tl.dot(x_lo, tl.trans(tl.reshape(w_lo, (BLOCK_N, BLOCK_K // 2)).to(x_lo.dtype)))
                acc += tl.dot(x_hi, tl.trans(tl.reshape(w_hi, (BLOCK_N, BLOCK_K // 2)).to(x_lo.dtype)))
                if GATE:
                    acc_up += tl.dot(x_lo, tl.trans(tl.reshape(u_lo, (BLOCK_N, BLOCK_K // 2)).to(x_lo.dtype)))
                    acc_up += tl.dot(x_hi, tl.trans(tl.reshape(u_hi, (BLOCK_N, BLOCK_K // 2)).to(x_lo.dtype)))
            else:
                # One row: the products added lane by lane into a tile of the step's shape, summed across threads
                # once, after the loop
                x_lo, x_hi = _x_halves(x_ptr, col, k0, live, offs_h, BLOCK_N, GROUP)
                # two fused multiply-adds a byte: `tile + x_lo * w_lo + x_hi * w_hi` compiled to a multiply, a
                # multiply-add and an add
                tile += x_lo * w_lo
                tile += x_hi * w_hi
                if GATE:
                    tile_up += x_lo * u_lo
                    tile_up += x_hi * u_hi
        if not USE_DOT:
            acc += tl.sum(tl.sum(tile, axis=2), axis=1)[None, :]
            if GATE:
                acc_up += tl.sum(tl.sum(tile_up, axis=2), axis=1)[None, :]
    elif USE_DOT:
        offs_k = tl.arange(0, BLOCK_K)
        for k0 in range(k_start, k_end, BLOCK_K):
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
            acc = dot_acc(acc, x, tl.where(w_mask, tl.load(q_rows + k[None, :], mask=w_mask).to(x.dtype), 0.0), True)
            if GATE:
                acc_up = dot_acc(acc_up, x, tl.where(w_mask, tl.load(u_rows + k[None, :], mask=w_mask).to(x.dtype),
                                                     0.0), True)
    else:
        # One row: the products added lane by lane into a [BLOCK_N, BLOCK_K] tile, summed across threads once,
        # after the loop. (Summed every step, the compiled loop moved partial sums through shared memory with
        # barriers; Triton 3.6, H100.) x is loaded at the tile's shape, so in the weights' layout (repeated
        # loads of the row are cache hits).
        offs_k = tl.arange(0, BLOCK_K)
        tile = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        tile_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            k = k0 + offs_k
            x_at = x_ptr + tl.broadcast_to(k[None, :], (BLOCK_N, BLOCK_K))
            if EVEN_K:
                w_mask = tl.broadcast_to(n_mask[:, None], (BLOCK_N, BLOCK_K))
                x = tl.load(x_at).to(tl.float32)
            else:
                w_mask = n_mask[:, None] & (k < K)[None, :]
                x = tl.load(x_at, mask=tl.broadcast_to((k < K)[None, :], (BLOCK_N, BLOCK_K)), other=0.0).to(tl.float32)
            w = tl.load(q_rows + k[None, :], mask=w_mask).to(tl.float32)
            if GATE:
                u = tl.load(u_rows + k[None, :], mask=w_mask).to(tl.float32)
            if not EVEN_K:  # masked lanes zeroed after the widening, as above
                w = tl.where(w_mask, w, 0.0)
                if GATE:
                    u = tl.where(w_mask, u, 0.0)
            # (with whole steps, only rows past N are masked: whatever their lanes hold stays in their own sums,
            # which are never stored)
            tile += x * w
            if GATE:
                tile_up += x * u
        acc += tl.sum(tile, axis=1)[None, :]
        if GATE:
            acc_up += tl.sum(tile_up, axis=1)[None, :]
    if not INT4:  # the per-channel scale, once
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATE:
            acc_up = acc_up * tl.load(s_ptr + N + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT > 1:
        # partial sums: the reduction adds them up and does the epilogue (`_split_reduce_epilogue_kernel`); gated,
        # the up half's partials sit N columns after the gate's
        if PDL:
            acc = release_successor(acc)
        out = y_ptr + (offs_m + tl.program_id(1) * M)[:, None] * stride_ym + offs_n[None, :]
        tl.store(out, acc, mask=out_mask)
        if GATE:
            tl.store(out + N, acc_up, mask=out_mask)
    else:
        if GATE:
            acc = acc / (1.0 + tl.exp(-acc)) * acc_up
        if RESIDUAL:
            acc += tl.load(r_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=out_mask,
                           other=0.0).to(tl.float32)
        if PDL:
            acc = release_successor(acc)
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _split_reduce_epilogue_kernel(p_ptr, y_ptr, r_ptr, MN, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                                  GATE: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr):
    """y = the sum of SPLIT partial results ([SPLIT, M, N] fp32, or gated [SPLIT, M, 2N]: gate then up), with the
    call site's epilogue: silu(gate) * up (GATE), + r (RESIDUAL, [M, N] contiguous); y [M, N] contiguous. The
    split-K matmul's reduction, so the epilogue costs no launch of its own."""
    if PDL:
        z = wait_for_predecessor()
        p_ptr, y_ptr, r_ptr = p_ptr + z, y_ptr + z, r_ptr + z
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    if GATE:
        src = offs // N * (2 * N) + offs % N
        part = 2 * MN
    else:
        src = offs
        part = MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    up = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(SPLIT):
        acc += tl.load(p_ptr + j * part + src, mask=mask, other=0.0)
        if GATE:
            up += tl.load(p_ptr + j * part + src + N, mask=mask, other=0.0)
    if GATE:
        acc = acc / (1.0 + tl.exp(-acc)) * up
    if RESIDUAL:
        acc += tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        acc = release_successor(acc)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def launch_shape(config: MatmulConfig, rows: int, k: int, group: int) -> tuple[int, int]:
    """(block_n, block_k) as launched: the candidates' own; a fixed configuration (`CONFIGS`) adapted where it
    cannot run as named. The tensor cores take 16 columns or more; fp8/int8 on 2+ rows, a 16 x 2048 tile of x
    and of w would not fit the registers (512 columns); int4, whole groups, at most MAX_GROUPS_A_STEP."""
    block_n, block_k = config.block_n, config.block_k
    if rows > 1:
        block_n = max(16, block_n)
        block_k = block_k if group else min(block_k, 512)
    if group:
        block_k = min(max(group, block_k // group * group), group * MAX_GROUPS_A_STEP)
    return block_n, block_k


def _launch(kernel: Any, x: Tensor, qweight: Tensor, scale: Tensor, zero: Tensor | None, y: Tensor,
            config: MatmulConfig, gate: bool = False, residual: Tensor | None = None,
            reduce: Any = lambda k: k) -> None:
    """Launch `kernel` (wrapped or not) and, for split-K, `reduce(_split_reduce_epilogue_kernel)` after it: the
    custom op wraps both for AOTInductor. `gate`: the weight holds gate and up, y is silu(gate) * up; `residual` is added
    to y."""
    m, k = x.shape
    n = qweight.shape[0] // (2 if gate else 1)
    int4 = zero is not None
    if m > MAX_ROWS or x.stride(1) != 1 or qweight.stride(1) != 1 or qweight.shape[1] * (2 if int4 else 1) != k:
        raise ValueError(f"quant_matmul takes x [<=16, K] and a quantized weight of K columns with contiguous rows, "
                         f"got {tuple(x.shape)}, {tuple(qweight.shape)} {qweight.dtype}")
    if residual is not None and (residual.shape != y.shape or residual.stride(1) != 1):
        raise ValueError(f"quant_matmul's residual must be [M, N] with contiguous rows, got {tuple(residual.shape)}")
    group = k // scale.shape[1] if int4 else 0
    split = config.split
    if split > 1 and (y.stride(0) != n or (residual is not None and residual.stride(0) != n)):
        raise ValueError(f"quant_matmul: split-K writes a contiguous output and reads a contiguous residual, got "
                         f"strides {y.stride()}{'' if residual is None else f' and {residual.stride()}'}")
    dot = m > 1
    block_n, block_k = launch_shape(config, m, k, group)
    pdl = waits_on(x.device)
    # the partial sums' rows: [split * M, N] fp32 (gated: [split * M, 2N], gate then up), every element written
    # (an empty slice writes zeros)
    target = y if split == 1 else torch.empty((split * m, 2 * n if gate else n), dtype=torch.float32,
                                              device=x.device)
    k_slice = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    # absent operands still need a pointer: the scale stands in, and the constexpr flags keep it unread
    kernel[(triton.cdiv(n, block_n), split)](
        x, qweight, scale, scale if zero is None else zero, target, scale if residual is None else residual,
        m, n, k, k_slice, x.stride(0), qweight.stride(0), scale.stride(0), target.stride(0),
        0 if residual is None else residual.stride(0), BLOCK_M=16 if dot else triton.next_power_of_2(m),
        # EVEN_K is read by fp8/int8 only: int4 always passes True, so that it compiles no variant for it
        BLOCK_N=block_n, BLOCK_K=block_k, INT4=int4, GROUP=max(group, 2), USE_DOT=dot,
        EVEN_K=int4 or k % block_k == 0, GATE=gate, RESIDUAL=residual is not None, PDL=pdl, SPLIT=split,
        ASM=x.device.type == "cuda",  # PTX only where it is compiled for a GPU, not in the interpreter
        num_warps=config.warps, num_stages=config.stages)
    if split > 1:  # the reduction, with the epilogue where there is one
        reduce(_split_reduce_epilogue_kernel)[(triton.cdiv(m * n, REDUCE_BLOCK),)](
            target, y, y if residual is None else residual, m * n, n, SPLIT=split, BLOCK=REDUCE_BLOCK, GATE=gate,
            RESIDUAL=residual is not None, PDL=pdl, num_warps=4)


def output_columns(qweight: Tensor, gate: bool) -> int:
    """y's columns: the weight's rows, half of them when it holds gate and up."""
    return qweight.shape[0] // 2 if gate else qweight.shape[0]


def quant_matmul(x: Tensor, qweight: Tensor, scale: Tensor, zero: Tensor | None, config: MatmulConfig,
                 out: Tensor | None = None, gate: bool = False, residual: Tensor | None = None) -> Tensor:
    """x [M, K] @ dequantize(weight)^T for M <= 16 (gated and with the residual added when asked), written into
    `out` when given (eager launch)."""
    y = (torch.empty((x.shape[0], output_columns(qweight, gate)), dtype=x.dtype, device=x.device) if out is None
         else out)
    _launch(_quant_matmul_kernel, x, qweight, scale, zero, y, config, gate, residual)
    return y


@triton_op("trtbuild::quant_matmul", mutates_args=())
def quant_matmul_op(x: Tensor, qweight: Tensor, scale: Tensor, zero: Tensor | None, block_n: int, block_k: int,
                    warps: int, stages: int, split: int = 1, gate: bool = False,
                    residual: Tensor | None = None) -> Tensor:
    """The kernel as a custom op: what a quantized engine's decode graphs call (`Linear._kernel`)."""
    y = torch.empty((x.shape[0], output_columns(qweight, gate)), dtype=x.dtype, device=x.device)
    _launch(wrap_triton(_quant_matmul_kernel), x, qweight, scale, zero, y,
            MatmulConfig(block_n, block_k, warps, stages, split), gate, residual, reduce=wrap_triton)
    return y


def reference(x: Tensor, qweight: Tensor, scale: Tensor, zero: Tensor | None, epilogue: str = "none",
              residual: Tensor | None = None) -> Tensor:
    """What the kernel computes with `epilogue` (none, gate, residual), in fp32 over the dequantized weight."""
    from trtbuild.models.quantize import dequantize

    y = F.linear(x.float(), dequantize(format_of(qweight, zero), qweight, scale, zero, x.dtype).float())
    if epilogue == "gate":
        a, b = y.chunk(2, dim=-1)
        y = F.silu(a) * b
    return y if residual is None else y + residual.float()


def format_of(qweight: Tensor, zero: Tensor | None) -> str:
    """The stored format of a quantized weight (models/quantize.py's names)."""
    return "int4" if zero is not None else "fp8" if qweight.dtype == torch.float8_e4m3fn else "int8"


def candidates_for(qweight: Tensor, scale: Tensor, zero: Tensor | None, rows: int,
                   epilogue: str = "none") -> list[MatmulConfig]:
    """The build's candidates for this weight at `rows` rows with `epilogue` (none, gate, residual), pruned for
    its shape and the device's multiprocessors."""
    fmt = format_of(qweight, zero)
    k = qweight.shape[1] * (2 if fmt == "int4" else 1)
    sms = (torch.cuda.get_device_properties(qweight.device).multi_processor_count
           if qweight.device.type == "cuda" else H100_SMS)
    return quant_candidates(fmt, rows, output_columns(qweight, epilogue == "gate"), k,
                            k // scale.shape[1] if fmt == "int4" else 0, sms, epilogue)


def select(layers: Sequence[tuple[Tensor, Tensor, Tensor | None]], rows: int, reps: int = 15,
           configs: Sequence[MatmulConfig] | None = None, epilogue: str = "none") -> dict[str, Any]:
    """Time every candidate (or `configs`) for `rows` x the weights of `layers` ((qweight, scale, zero) of one
    format and shape, e.g. every layer's QKV: distinct tensors, so none is served from L2 as in a real step)
    inside a CUDA graph, per call, each doing `epilogue` (none; gate: the weight holds gate and up; residual: an
    add). Returns {"format", "epilogue", "choice": the fastest config name or None, "candidates": {name: us |
    error}}. A candidate whose result differs from `reference` beyond bf16 rounding is refused, never chosen."""
    q0, s0, z0 = layers[0]
    fmt = format_of(q0, z0)
    k = q0.shape[1] * (2 if fmt == "int4" else 1)
    gate = epilogue == "gate"
    width = output_columns(q0, gate)
    x = torch.randn(rows, k, device=q0.device, dtype=torch.bfloat16)
    residual = torch.randn(rows, width, device=q0.device, dtype=x.dtype) if epilogue == "residual" else None
    ref = reference(x, q0, s0, z0, epilogue, residual)
    ys = [torch.empty(rows, width, device=q0.device, dtype=x.dtype) for _ in layers]
    result: dict[str, Any] = {"format": fmt, "epilogue": epilogue, "candidates": {}}
    best, best_us = None, float("inf")
    for config in configs if configs is not None else candidates_for(q0, s0, z0, rows, epilogue):
        try:
            got = quant_matmul(x, q0, s0, z0, config, out=ys[0], gate=gate, residual=residual).float()
            err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            if not err <= TOLERANCE:
                result["candidates"][config.name] = f"refused: max relative error {err:.3g} against the dequantized matmul"
                continue

            def calls(config: MatmulConfig = config) -> None:
                for (q, s, z), y in zip(layers, ys, strict=True):
                    quant_matmul(x, q, s, z, config, out=y, gate=gate, residual=residual)

            us = graph_seconds(calls, reps) / len(layers) * 1e6
        except Exception as e:  # a configuration that does not compile here is a measurement too
            first = str(e).splitlines()[0][:120] if str(e) else ""
            result["candidates"][config.name] = f"failed: {type(e).__name__}: {first}"
            continue
        result["candidates"][config.name] = us
        if us < best_us:
            best, best_us = config.name, us
    result["choice"] = best
    return result
