"""Weight quantization at build time: the stored formats, round-to-nearest, and their dequantization.

A quantized Linear holds, instead of its weight, buffers in one of three formats (`FORMATS`):

- `fp8`: `qweight` float8 e4m3 (N, K), `scale` fp32 (N,): w = q * scale, per output channel.
- `int8`: `qweight` int8 (N, K), `scale` fp32 (N,): w = q * scale, symmetric, per output channel.
- `int4`: `qweight` uint8 (N, K/2), `scale` and `zero` bf16 (N, K/G): w = (q - zero) * scale with q in
  0..15, per group of G input columns (`group_size`). Two nibbles a byte, in "split halves" within each
  group: byte i of a group holds column i in its low nibble and column i + G/2 in its high one. A decode
  kernel that reads a group's G/2 bytes with one wide load then has two contiguous half-groups to
  multiply with two contiguous slices of x, with no interleaving of registers.

Scales of fp8 and int8 are fp32 because fp8 prefill hands them to `torch._scaled_mm`, which takes fp32
row-wise scales; per channel they are a negligible share of the bytes. int4's are bf16 (with the zero,
4 bytes per group of 64-128 half-bytes: 6% of the weight bytes at G=128, 12% at G=64).

The zero point is stored as a bf16 number of quantization steps, not rounded to an integer: with min/max
per group (what `quantize_int4` does), q = 0 and q = 15 then land exactly on the group's extremes.

This module is a leaf (torch only): the model (`llama.Linear`) dequantizes through it, and the calibrated
methods (`calibrate.py`, `gptq.py`) quantize through it.
"""

from __future__ import annotations

import torch
from torch import Tensor

# recipe precision -> stored weight format
FORMATS = {"fp8": "fp8", "int8_wo": "int8", "int4_wo": "int4"}
FP8_MAX = 448.0  # largest finite float8 e4m3fn
INT4_GROUPS = (128, 64, 32)  # preferred first: fewer scales; a layer takes the largest dividing its width


def is_quantized(precision: str) -> bool:
    """Whether a recipe precision stores quantized weights."""
    return precision in FORMATS


def group_size(in_features: int) -> int:
    """int4's group along the input: 128, or the largest of 64 and 32 that divides `in_features`
    (SmolLM2's 576 does not divide by 128). Raises ValueError when none does."""
    for g in INT4_GROUPS:
        if in_features % g == 0:
            return g
    raise ValueError(f"an input width of {in_features} is not a multiple of 32, the smallest int4 group")


def quantize_fp8(w: Tensor) -> dict[str, Tensor]:
    """float8 e4m3 with one fp32 scale per output row, the row's largest magnitude mapped to 448."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    q = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"qweight": q, "scale": scale}


def quantize_int8(w: Tensor) -> dict[str, Tensor]:
    """Symmetric int8 with one fp32 scale per output row (round to nearest, -127..127)."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return {"qweight": q, "scale": scale}


def int4_params(w: Tensor, group: int, clip: Tensor | float = 1.0) -> tuple[Tensor, Tensor]:
    """Scale and zero (N, K/G), fp32 but bf16-representable, for w's groups from their min and max
    (each shrunk toward the group's middle by `clip`, a number or an (N, K/G) tensor, for clipping searches)."""
    n, k = w.shape
    g = w.float().reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    if not isinstance(clip, float) or clip != 1.0:
        mid = (lo + hi) / 2
        lo, hi = mid + (lo - mid) * clip, mid + (hi - mid) * clip
    scale = ((hi - lo) / 15.0).clamp(min=1e-8).to(torch.bfloat16).float()
    zero = (-lo / scale).to(torch.bfloat16).float()
    return scale, zero


def int4_codes(w: Tensor, scale: Tensor, zero: Tensor) -> Tensor:
    """Round-to-nearest codes 0..15 (N, K) uint8 of w under group parameters (N, K/G)."""
    n, k = w.shape
    group = k // scale.shape[1]
    g = w.float().reshape(n, k // group, group)
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp(0, 15)
    return q.reshape(n, k).to(torch.uint8)


def quantize_int4(w: Tensor, group: int | None = None, clip: Tensor | float = 1.0) -> dict[str, Tensor]:
    """Round-to-nearest int4 in groups along the input, with bf16 scales and zero points, packed."""
    group = group or group_size(w.shape[1])
    scale, zero = int4_params(w, group, clip)
    return {"qweight": pack_int4(int4_codes(w, scale, zero), group),
            "scale": scale.to(torch.bfloat16), "zero": zero.to(torch.bfloat16)}


def pack_int4(q: Tensor, group: int) -> Tensor:
    """(N, K) codes 0..15 -> (N, K/2) uint8, split halves within each group (see the module's notes)."""
    n, k = q.shape
    g = q.to(torch.uint8).reshape(n, k // group, group)
    lo, hi = g[..., : group // 2], g[..., group // 2:]
    return (lo | (hi << 4)).reshape(n, k // 2)


def unpack_int4(packed: Tensor, group: int) -> Tensor:
    """(N, K/2) uint8 -> (N, K) codes 0..15 as uint8; `pack_int4`'s inverse."""
    n, half = packed.shape
    p = packed.reshape(n, half * 2 // group, group // 2)
    return torch.cat([p & 15, p >> 4], dim=-1).reshape(n, half * 2)


def quantize(fmt: str, w: Tensor, group: int | None = None) -> dict[str, Tensor]:
    """w (N, K) in one of `FORMATS`' formats, round to nearest: the buffers of a quantized Linear."""
    if fmt == "fp8":
        return quantize_fp8(w)
    if fmt == "int8":
        return quantize_int8(w)
    if fmt == "int4":
        return quantize_int4(w, group)
    raise ValueError(f"unknown weight format {fmt!r}")


def dequantize(fmt: str, qweight: Tensor, scale: Tensor, zero: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The (N, K) weight in `dtype` that the stored tensors stand for: the reference every kernel is
    tested against, and what the model's graphs compute with on the CPU."""
    if fmt in ("fp8", "int8"):
        return (qweight.to(torch.float32) * scale.float()[:, None]).to(dtype)
    if fmt == "int4":
        assert zero is not None  # int4 Linears always carry one
        n = qweight.shape[0]
        groups = scale.shape[1]
        group = qweight.shape[1] * 2 // groups
        q = unpack_int4(qweight, group).reshape(n, groups, group).to(torch.float32)
        return ((q - zero.float()[..., None]) * scale.float()[..., None]).reshape(n, groups * group).to(dtype)
    raise ValueError(f"unknown weight format {fmt!r}")


def stored_shapes(fmt: str, out_features: int, in_features: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The buffers a quantized Linear of this shape holds: name -> (shape, dtype)."""
    if fmt == "fp8":
        return {"qweight": ((out_features, in_features), torch.float8_e4m3fn), "scale": ((out_features,), torch.float32)}
    if fmt == "int8":
        return {"qweight": ((out_features, in_features), torch.int8), "scale": ((out_features,), torch.float32)}
    if fmt == "int4":
        groups = in_features // group_size(in_features)
        return {"qweight": ((out_features, in_features // 2), torch.uint8),
                "scale": ((out_features, groups), torch.bfloat16), "zero": ((out_features, groups), torch.bfloat16)}
    raise ValueError(f"unknown weight format {fmt!r}")


def format_of(qweight: Tensor) -> str:
    """The format of a stored `qweight`, from its dtype."""
    return {torch.float8_e4m3fn: "fp8", torch.int8: "int8", torch.uint8: "int4"}[qweight.dtype]


def fp8_linear(x: Tensor, qweight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """x @ W^T (+ b) on fp8 tensor cores (CUDA, compute capability 8.9+): x is quantized to float8 e4m3 per
    token (row) with a dynamic scale, W is fp8 with its per-channel scale, and `torch._scaled_mm` applies
    both scales to its fp32 accumulators (row-wise scaling). Output in x's dtype."""
    rows = x.reshape(-1, x.shape[-1])
    x_scale = (rows.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    xq = (rows.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    y = torch._scaled_mm(xq, qweight.t(), scale_a=x_scale, scale_b=scale.float()[None, :], out_dtype=x.dtype)
    y = y if bias is None else y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])
