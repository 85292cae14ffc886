"""Triton pieces the decode matmuls share (`decode_matmul.py` for dense weights, `quant_matmul.py` for quantized
ones): the step's multiply-accumulate and the split-K reduction.

One copy, so a change to either reaches both kernels; each kernel's `source_digest` covers this file, so a
compiled graph or a cached timing that calls one of them is not reused across such a change.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import triton
import triton.language as tl

from trtbuild.kernels.grid_dependency import release_successor, wait_for_predecessor

REDUCE_BLOCK = 1024  # elements of the output one program of `_split_reduce_kernel` adds up
# (the kernel's name is what backends/torch/pdl.py recognizes among the kernels of a captured graph)
# (its name is what backends/torch/pdl.py recognizes among the kernels of a captured graph)


def source_digest() -> str:
    """This file's content, for the digests of the kernels that call it."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


@triton.jit
def dot_acc(acc, x, w, USE_DOT: tl.constexpr):
    """acc + x @ w^T for one step, w already in x's dtype. With USE_DOT a tensor-core dot, whose 16 rows the
    caller pads with masked zeros (they cost no memory traffic); without, a multiply-and-sum in fp32 (one row:
    a dot would pad it 16x in registers)."""
    if USE_DOT:
        acc += tl.dot(x, tl.trans(w))
    else:
        acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
    return acc


@triton.jit
def _split_reduce_kernel(p_ptr, y_ptr, MN, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y = the sum of SPLIT partial results, [SPLIT, M, N] fp32 contiguous, as y's dtype ([M, N] contiguous)."""
    if PDL:
        z = wait_for_predecessor()
        p_ptr, y_ptr = p_ptr + z, y_ptr + z
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(SPLIT):
        acc += tl.load(p_ptr + j * MN + offs, mask=mask, other=0.0)
    if PDL:
        acc = release_successor(acc)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
