"""A Triton mixture-of-experts step for decode: each token's chosen experts, their weights read in place.

Why it exists: a decode step of Qwen3-30B-A3B multiplies 1-8 tokens by 8 of 128 experts a layer. ATen's
form (`moe.MoE._gathered`) indexes the stacked weights with the chosen ids, which copies the k experts'
matrices before the matmul reads them: three passes over the bytes that matter. Here each program owns one
(token, chosen expert) pair and a block of output columns, looks the expert up and streams its rows of the
stacked weight once. Two launches a layer: gate/up with the SiLU gating folded in (a program reads the
gate row and the up row of each of its columns), then down; the routing weights and the sum over the k
experts are a small ATen epilogue.

Registered as the custom op `trtbuild::moe_gathered` so that export records it and AOTInductor compiles it
into the decode graphs (`MoE.decode_kernel`, set by the backend for CUDA builds with
options.moe_decode kernel). Imported only where Triton is present. Not yet run on a GPU: tested through
Triton's interpreter against the ATen path (tests/test_kernels.py).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

BLOCK_N, BLOCK_K, WARPS = 64, 128, 4


def source_digest() -> str:
    """This file's content: a compiled graph that calls the kernel is only reusable with the same kernel."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


@triton.jit
def _expert_rows(x_ptr, w_ptr, ids_ptr, y_ptr, K: tl.constexpr, N_OUT, CHOSEN, GATED: tl.constexpr,
                 PER_CHOICE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[p, cols] = W[ids[p]][cols] @ x[row] for the pair p = (token, j) this program owns; with GATED the
    weight holds [gate | up] rows (2 N_OUT of them) and y = silu(gate) * up. x's row is the token's
    (PER_CHOICE false: the layer's input) or the pair's own (the gated activations, for down)."""
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row = pair if PER_CHOICE else pair // CHOSEN
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = 2 * N_OUT if GATED else N_OUT
    base = w_ptr + expert * rows * K
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * K + ks, mask=ks < K, other=0.0).to(tl.float32)
        mask = (cols[:, None] < N_OUT) & (ks[None, :] < K)
        w = tl.load(base + cols[:, None] * K + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
        if GATED:
            w_up = tl.load(base + (cols[:, None] + N_OUT) * K + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            up += tl.sum(w_up * x[None, :], axis=1)
    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * up
    tl.store(y_ptr + pair * N_OUT + cols, acc.to(y_ptr.dtype.element_ty), mask=cols < N_OUT)


def _launch(kernel: object, x: Tensor, w: Tensor, ids: Tensor, y: Tensor, gated: bool, per_choice: bool) -> None:
    n_out, k = y.shape[1], x.shape[1]
    grid = (ids.numel(), triton.cdiv(n_out, BLOCK_N))
    kernel[grid](x, w, ids, y, k, n_out, ids.shape[-1], GATED=gated, PER_CHOICE=per_choice,  # type: ignore[index]
                 BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=WARPS)


@triton_op("trtbuild::moe_gathered", mutates_args=())
def moe_gathered_op(x: Tensor, w13: Tensor, w2: Tensor, chosen: Tensor, weights: Tensor) -> Tensor:
    """sum_j weights[n, j] * expert_{chosen[n, j]}(x[n]) for x (N, D), w13 (E, 2F, D), w2 (E, D, F), chosen and
    weights (N, k): what `MoE._gathered` computes, without copying the experts' weights."""
    n, k = chosen.shape
    f, d = w2.shape[2], w2.shape[1]
    ids = chosen.contiguous()
    gated = torch.empty(n * k, f, dtype=x.dtype, device=x.device)
    _launch(wrap_triton(_expert_rows), x.contiguous(), w13, ids, gated, True, False)
    out = torch.empty(n * k, d, dtype=x.dtype, device=x.device)
    _launch(wrap_triton(_expert_rows), gated, w2, ids, out, False, True)
    return (out.view(n, k, d) * weights[..., None]).sum(1)
