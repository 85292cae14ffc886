"""GPTQ's per-channel column loop as one Triton launch a block (kernels/gptq_block.py) against the torch loop
(`calibrate.channel_block`): through Triton's interpreter on the CPU, compiled on a GPU. Skipped where Triton is
not installed."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # read when the kernels are defined, so before they are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _hinv(b: int, g: torch.Generator) -> torch.Tensor:
    """The upper Cholesky factor of the inverse of a random positive definite (b, b), as gptq_channel makes it."""
    x = torch.randn(4 * b, b, generator=g)
    h = x.T @ x / (4 * b) + 0.01 * torch.eye(b)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_the_rounding_is_the_formats_own_on_every_binade_and_tie(fmt: str) -> None:
    """With no error to spread (H^-1's factor the identity), the codes are round to nearest in the format: fp8
    e4m3 across its normal range and its subnormals, ties to even, and clamped to its top; int8 ties to even."""
    from trtbuild.kernels.gptq_block import channel_block

    top = 448.0 if fmt == "fp8" else 127.0
    g = torch.Generator().manual_seed(1)
    mags = torch.exp2(torch.empty(4096).uniform_(-12, 9.5, generator=g)) if fmt == "fp8" else \
        torch.empty(4096).uniform_(0, 140, generator=g)
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 1.0625, 1.1875, 2 ** -7 + 2 ** -10, 3 * 2 ** -10, 0.0, 500.0])
    x = torch.cat([mags * torch.where(torch.rand(4096, generator=g) < 0.5, -1.0, 1.0), ties])
    w = torch.nn.functional.pad(x, (0, 64 - x.numel() % 64)).reshape(-1, 64)
    scale = torch.ones(w.shape[0])
    codes, errors = channel_block(w.to(DEVICE), torch.eye(64).to(DEVICE), scale.to(DEVICE), fmt)
    clamped = w.clamp(-top, top)
    want = clamped.to(torch.float8_e4m3fn).float() if fmt == "fp8" else torch.round(clamped)
    assert torch.equal(codes.cpu(), want)
    assert torch.equal(errors.cpu(), w - want)


@pytest.mark.parametrize(("fmt", "n", "b"), [("fp8", 70, 128), ("int8", 70, 128), ("fp8", 33, 48)])
def test_the_block_matches_the_torch_loop(fmt: str, n: int, b: int) -> None:
    """Rows not a multiple of a program's band and a block narrower than 128 (masked columns), on a view of a wider
    weight: the codes are the torch loop's nearly everywhere (a last-bit difference in the spread errors can move
    a value across a rounding boundary) and the errors agree to fp32 precision."""
    from trtbuild.kernels.gptq_block import channel_block
    from trtbuild.models import calibrate

    g = torch.Generator().manual_seed(n + b)
    whole = torch.randn(n, b + 64, generator=g) * torch.linspace(0.02, 1.0, n)[:, None]
    w = whole[:, 16:16 + b]
    hinv = _hinv(b, g)
    scale = whole.abs().amax(dim=1) / (448.0 if fmt == "fp8" else 127.0)
    want_codes, want_errors = calibrate.channel_block(w, hinv, scale, fmt)
    codes, errors = channel_block(w.to(DEVICE), hinv.to(DEVICE), scale.to(DEVICE), fmt)
    assert (codes.cpu() == want_codes).float().mean() > 0.995
    torch.testing.assert_close(errors.cpu(), want_errors, rtol=1e-3, atol=1e-3 * want_errors.abs().max().item())
    assert torch.equal(whole[:, 16:16 + b], w)  # the weight is left as it was
