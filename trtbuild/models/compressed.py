"""Checkpoints already quantized in the compressed-tensors FP8 format (llm-compressor's "FP8" and
"FP8_DYNAMIC" schemes): float8 e4m3 weights with a `weight_scale` per tensor or per output channel.

`apply` puts their Linears into a converted state dict as they are stored: an `fp8` engine takes the fp8
bytes and scales unchanged (`quantize.py`'s fp8 format: a per-tensor scale becomes the same scale for
every channel), so nothing is quantized twice; any other precision gets the weights dequantized
(weight * scale), never the bare fp8 values that a cast would give. Other compressed-tensors schemes
(packed int4/int8) are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trtbuild.errors import InputError
from trtbuild.models.families import fp8_scheme  # config-only: it lives with the config reading

# the model's fused Linears and the Hugging Face projections they concatenate
FUSED = {"attention.wqkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "attention.wo": ("self_attn.o_proj",), "feed_forward.w13": ("mlp.gate_proj", "mlp.up_proj"),
         "feed_forward.w2": ("mlp.down_proj",)}


def _raw_tensors(folder: Path, names: set[str]) -> dict[str, Tensor]:
    """The named tensors of the checkpoint as stored (no cast)."""
    from safetensors import safe_open

    from trtbuild.models.checkpoint import weight_files

    found: dict[str, Tensor] = {}
    for file in weight_files(folder):
        with safe_open(str(file), framework="pt") as f:
            found |= {n: f.get_tensor(n) for n in f.keys() if n in names}
    missing = sorted(names - set(found))
    if missing:
        raise InputError(f"{folder}: compressed-tensors checkpoint without {', '.join(missing[:3])}")
    return found


def apply(folder: Path, raw: dict[str, Any], num_layers: int, state: dict[str, Tensor],
          keep_fp8: bool) -> dict[str, Tensor]:
    """`state` (converted, the model's layout) with each decoder Linear taken from the FP8 checkpoint in
    `folder`: fp8 `qweight` + per-channel `scale` when `keep_fp8`, else the dequantized weight in the
    state's dtype. `state` unchanged for a checkpoint that is not compressed-tensors."""
    if fp8_scheme(raw, folder / "config.json") is None:
        return state
    out = dict(state)
    for i in range(num_layers):
        for fused, parts in FUSED.items():
            prefix = [f"model.layers.{i}.{p}" for p in parts]
            t = _raw_tensors(folder, {f"{p}.{s}" for p in prefix for s in ("weight", "weight_scale")})
            weights = [t[f"{p}.weight"] for p in prefix]
            if any(w.dtype != torch.float8_e4m3fn for w in weights):
                raise InputError(f"{folder}: {prefix[0]}.weight is {weights[0].dtype}, not float8_e4m3fn")
            scales = [t[f"{p}.weight_scale"].float().reshape(-1).expand(w.shape[0]) for p, w in zip(prefix, weights)]
            qweight, scale = torch.cat(weights), torch.cat(scales).contiguous()
            name = f"layers.{i}.{fused}"
            dtype = out.pop(f"{name}.weight").dtype
            if keep_fp8:
                out[f"{name}.qweight"], out[f"{name}.scale"] = qweight, scale
            else:
                out[f"{name}.weight"] = (qweight.float() * scale[:, None]).to(dtype)
    return out
