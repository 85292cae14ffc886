"""trtbuild's Triton mixture-of-experts gather (kernels/moe_gather.py) against the model's ATen paths: through
Triton's interpreter on the CPU (fp32; skipped where Triton is not installed), compiled on a GPU (bf16)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():  # read when the kernels are defined, so before they are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def moe(experts: int, top_k: int, hidden: int, inner: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from trtbuild.models.moe import MoE

    cfg = SimpleNamespace(num_experts=experts, experts_per_token=top_k, norm_topk_prob=True, hidden_size=hidden,
                          moe_intermediate_size=inner)
    m = MoE(cfg)
    g = torch.Generator().manual_seed(experts * hidden + inner)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return m.to(DEVICE, dtype)


@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inner"),
                         [(1, 8, 2, 64, 48), (3, 6, 3, 40, 72), (8, 16, 4, 200, 130)])
def test_the_gather_kernel_computes_the_models_experts(tokens: int, experts: int, top_k: int, hidden: int,
                                                       inner: int) -> None:
    """Sizes that are not multiples of the kernel's blocks (40, 130, 200), several tokens choosing overlapping
    experts: the kernel's output is the ATen gather's and the dense path's."""
    m = moe(experts, top_k, hidden, inner)
    x = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    with torch.no_grad():
        want = m(x, lambda t: t, None, gathered=True)
        dense = m(x, lambda t: t, None, gathered=False)
        m.decode_kernel = "kernel"
        got = m(x, lambda t: t, None, gathered=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(want, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_the_gather_kernel_in_bf16_on_the_gpu_is_within_rounding_of_aten() -> None:
    m = moe(128, 8, 2048, 768, torch.bfloat16)
    x = torch.randn(1, 8, 2048, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        want = m(x, lambda t: t, None, gathered=True).float()
        m.decode_kernel = "kernel"
        got = m(x, lambda t: t, None, gathered=True).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
