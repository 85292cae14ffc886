"""The checkpoint tensors of each layer, for every family (models/families.py), and their mapping onto the
engine's layout (models/llama.py: wqkv, w13, w2; models/moe.py: stacked experts).

Llama's tensors (Mistral's and Qwen2's too) are the default case: separate q/k/v and gate/up/down
projections and two norms a layer. The other families' names are those of their Hugging Face checkpoints
on the hub (what transformers' `save_pretrained` writes): Phi-3's fused qkv_proj and gate_up_proj; Gemma's four norms a layer, gains
stored as gain - 1; Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2 and Qwen3-MoE's
mlp.experts.{e}.gate_proj/up_proj/down_proj, stacked into one tensor per projection here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

GEMMA_NORMS = {"input_layernorm": "attention_norm", "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffn_norm"}
LLAMA_NORMS = {"input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm"}


def _experts(cfg: Any, i: int) -> tuple[str, tuple[str, str, str]] | None:
    """(prefix of layer i's experts, names of their gate, up and down projections), or None for a dense layer."""
    if not (cfg.moe_layers and cfg.moe_layers[i]):
        return None
    if cfg.model_type == "mixtral":
        return f"model.layers.{i}.block_sparse_moe.", ("w1", "w3", "w2")
    return f"model.layers.{i}.mlp.", ("gate_proj", "up_proj", "down_proj")


def family_shapes(cfg: Any, i: int) -> dict[str, tuple[int, ...]]:
    """The tensors of layer i that a checkpoint of this family must hold, with their shapes."""
    d, f, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * hd, cfg.num_kv_heads * hd
    a, m, p = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"model.layers.{i}."
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.model_type == "phi3":
        shapes[a + "qkv_proj.weight"] = (q + 2 * kv, d)
    else:
        shapes.update({a + "q_proj.weight": (q, d), a + "k_proj.weight": (kv, d), a + "v_proj.weight": (kv, d)})
    shapes[a + "o_proj.weight"] = (d, q)
    if cfg.qkv_bias:
        shapes.update({a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)})
    if cfg.o_bias:
        shapes[a + "o_proj.bias"] = (d,)
    if cfg.qk_norm:
        shapes.update({a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
    experts = _experts(cfg, i)
    if experts is not None:
        prefix, (gate, up, down) = experts
        fm = cfg.moe_intermediate_size
        shapes[prefix + "gate.weight"] = (cfg.num_experts, d)
        for e in range(cfg.num_experts):
            x = f"{prefix}experts.{e}."
            shapes.update({x + f"{gate}.weight": (fm, d), x + f"{up}.weight": (fm, d), x + f"{down}.weight": (d, fm)})
    elif cfg.model_type == "phi3":
        shapes.update({m + "gate_up_proj.weight": (2 * f, d), m + "down_proj.weight": (d, f)})
    else:
        shapes.update({m + "gate_proj.weight": (f, d), m + "up_proj.weight": (f, d), m + "down_proj.weight": (d, f)})
    if cfg.mlp_bias and experts is None:
        shapes.update({m + "gate_proj.bias": (f,), m + "up_proj.bias": (f,), m + "down_proj.bias": (d,)})
    for name in GEMMA_NORMS if cfg.sandwich_norms else LLAMA_NORMS:
        shapes[p + f"{name}.weight"] = (d,)
    return shapes


def convert_family(hf: dict[str, Tensor], cfg: Any, out: dict[str, Tensor]) -> dict[str, Tensor]:
    """`out` (the embeddings, final norm and LM head already mapped) with every layer's tensors in the
    engine's layout; Gemma's norm gains as the gains themselves. Raises KeyError naming a missing tensor."""
    for i in range(cfg.num_layers):
        a, m, p, o = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"model.layers.{i}.", f"layers.{i}."
        if cfg.model_type == "phi3":
            out[o + "attention.wqkv.weight"] = hf[a + "qkv_proj.weight"]
        else:
            out[o + "attention.wqkv.weight"] = torch.cat([hf[a + f"{n}_proj.weight"] for n in "qkv"])
        if cfg.qkv_bias:
            out[o + "attention.wqkv.bias"] = torch.cat([hf[a + f"{n}_proj.bias"] for n in "qkv"])
        out[o + "attention.wo.weight"] = hf[a + "o_proj.weight"]
        if cfg.o_bias:
            out[o + "attention.wo.bias"] = hf[a + "o_proj.bias"]
        if cfg.qk_norm:
            out[o + "attention.q_norm.weight"] = hf[a + "q_norm.weight"]
            out[o + "attention.k_norm.weight"] = hf[a + "k_norm.weight"]
        experts = _experts(cfg, i)
        if experts is not None:
            prefix, (gate, up, down) = experts
            x = [f"{prefix}experts.{e}." for e in range(cfg.num_experts)]
            out[o + "feed_forward.gate"] = hf[prefix + "gate.weight"]
            out[o + "feed_forward.w13"] = torch.stack([torch.cat([hf[e + f"{gate}.weight"], hf[e + f"{up}.weight"]])
                                                       for e in x])
            out[o + "feed_forward.w2"] = torch.stack([hf[e + f"{down}.weight"] for e in x])
        else:
            if cfg.model_type == "phi3":
                out[o + "feed_forward.w13.weight"] = hf[m + "gate_up_proj.weight"]
            else:
                out[o + "feed_forward.w13.weight"] = torch.cat([hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]])
            out[o + "feed_forward.w2.weight"] = hf[m + "down_proj.weight"]
            if cfg.mlp_bias:
                out[o + "feed_forward.w13.bias"] = torch.cat([hf[m + "gate_proj.bias"], hf[m + "up_proj.bias"]])
                out[o + "feed_forward.w2.bias"] = hf[m + "down_proj.bias"]
        for name, ours in (GEMMA_NORMS if cfg.sandwich_norms else LLAMA_NORMS).items():
            out[o + f"{ours}.weight"] = hf[p + f"{name}.weight"]
    if cfg.unit_offset_norms:  # the gain is 1 + weight, added in fp32 and rounded once
        for name, t in out.items():
            if name.endswith("norm.weight"):
                out[name] = (t.float() + 1.0).to(t.dtype)
    return out
