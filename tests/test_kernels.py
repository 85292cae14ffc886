"""trtbuild's Triton kernels on the CPU, through Triton's interpreter (TRITON_INTERPRET=1), against the
model's own ATen code. Skipped where Triton is not installed (CI's CPU torch does not bring it; the H200
runs the compiled kernels in tests/test_gpu.py and benchmarks/attention_probe.py). fp32 throughout: the
interpreter's bf16 dot is not reliable."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # read when the kernels are defined, so before they are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("batch", "heads", "kv_heads", "head_dim", "pos"),
                         [(1, 8, 2, 16, 0), (2, 8, 2, 16, 40), (1, 4, 4, 32, 127), (3, 6, 2, 16, 250)])
def test_decode_attention_matches_the_masked_attention_of_the_model(
        batch: int, heads: int, kv_heads: int, head_dim: int, pos: int) -> None:
    """Every position from the first slot to past several slices, with and without grouped queries,
    and fewer sequences than the cache holds (the kernel must read only the first `batch`)."""
    from trtbuild.models.decode_attention import decode_attention
    from trtbuild.models.llama import _cached_attention

    g = torch.Generator().manual_seed(pos)
    q = torch.randn(batch, 1, heads, head_dim, generator=g).to(DEVICE)
    k_cache, v_cache = (torch.randn(batch + 1, kv_heads, 300, head_dim, generator=g).to(DEVICE) for _ in range(2))
    p = torch.tensor([pos], device=DEVICE)
    got = decode_attention(q, k_cache, v_cache, p)
    want = _cached_attention(q.transpose(1, 2), k_cache[:batch], v_cache[:batch], p,
                             torch.arange(pos + 1, device=DEVICE)).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
