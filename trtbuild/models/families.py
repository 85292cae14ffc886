"""The model families trtbuild builds, and what each one's config.json asks of the shared decoder.

Every family is the Llama decoder (models/llama.py) with a few config-driven features switched on:
- qwen3: RMSNorm over each head's query and key before rope (`qk_norm`).
- phi3: the checkpoint fuses q/k/v and gate/up (the engine's own layout); longrope scaling.
- gemma2, gemma3_text: norms after attention and the MLP too (`sandwich_norms`), RMSNorm gains stored as
  (1 + weight), embeddings scaled by sqrt(hidden_size), GELU-tanh gating, a query scale from
  `query_pre_attn_scalar`, sliding-window layers between global ones (Gemma 3 with a rope base of their
  own), logit soft-capping where the config has it.
- mixtral, qwen3_moe: a mixture of experts in place of the MLP (models/moe.py).

`family_fields` turns a raw config into the extra `LlamaConfig` fields; `refused_fields` names every field
whose value would change the model in a way trtbuild does not implement, so that it is refused at
`trtbuild validate` instead of silently ignored. No torch here: recipe and checkpoint reading use it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trtbuild.errors import InputError

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                 "gemma3_text": "Gemma3ForCausalLM", "mixtral": "MixtralForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
GEMMA = ("gemma2", "gemma3_text")
MOE = ("mixtral", "qwen3_moe")
# transformers' defaults where they differ from Llama's, for fields a config.json may leave out (a synthetic
# recipe's config does): trtbuild must read a folder as transformers does.
DEFAULTS: dict[str, dict[str, Any]] = {
    "mistral": {"sliding_window": 4096},
    "qwen3": {"head_dim": 128},
    "gemma2": {"head_dim": 256, "sliding_window": 4096, "query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0, "tie_word_embeddings": True, "sliding_window_pattern": 2,
               "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3_text": {"head_dim": 256, "sliding_window": 4096, "query_pre_attn_scalar": 256, "rope_theta": 1e6,
                    "rope_local_base_freq": 1e4, "tie_word_embeddings": True, "sliding_window_pattern": 6,
                    "hidden_activation": "gelu_pytorch_tanh"},
    "mixtral": {"rope_theta": 1e6, "num_experts_per_tok": 2, "num_local_experts": 8},
    # the count of experts: num_experts on the hub, num_local_experts as transformers 5 saves it (128 if neither)
    "qwen3_moe": {"num_experts_per_tok": 8, "norm_topk_prob": False, "moe_intermediate_size": 768, "decoder_sparse_step": 1},
}
# The activations each family's MLP may use, as config.json names them.
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# Fields the loader reads in some family but that only a family that implements them may carry.
_FAMILY_ONLY = {"query_pre_attn_scalar": GEMMA, "final_logit_softcapping": GEMMA, "attn_logit_softcapping": GEMMA,
                "rope_local_base_freq": ("gemma3_text",)}


def with_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with transformers' defaults of its family for the fields it leaves out (`DEFAULTS`). A rope base
    inside rope_parameters (transformers 5: at its top or per layer type) counts as given."""
    defaults = dict(DEFAULTS.get(cfg.get("model_type", "llama"), {}))
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ("rope_theta" in params or any(
            isinstance(v, dict) and "rope_theta" in v for v in params.values())):
        defaults.pop("rope_theta", None)
    return {**defaults, **cfg}


def family_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """The `LlamaConfig` fields beyond Llama's that `cfg` (a raw config.json) sets; raises KeyError,
    TypeError or ValueError for the loader to report."""
    kind = cfg.get("model_type", "llama")
    layers = int(cfg["num_hidden_layers"])
    out: dict[str, Any] = {"model_type": kind}
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    out["hidden_act"] = ACTIVATIONS.get(act, act)
    if kind in ("qwen3", "qwen3_moe", "gemma3_text"):
        out["qk_norm"] = True
    if kind in GEMMA:
        out["sandwich_norms"] = True
        out["unit_offset_norms"] = True
        out["embed_scale"] = math.sqrt(int(cfg["hidden_size"]))
        out["attn_scale"] = float(cfg["query_pre_attn_scalar"]) ** -0.5
        # Gemma 3 has the field but transformers' Gemma 3 never applies it (refused_fields refuses a value)
        out["attn_softcap"] = _positive_or_none(cfg.get("attn_logit_softcapping")) if kind == "gemma2" else None
        out["final_softcap"] = _positive_or_none(cfg.get("final_logit_softcapping"))
    out["layer_windows"] = _layer_windows(cfg, kind, layers)
    if kind == "gemma3_text":
        local = _local_rope(cfg)
        if local is not None:
            out["local_rope_theta"], out["local_rope_scaling"] = local
    if kind in MOE:
        experts = cfg["num_local_experts"] if kind == "mixtral" else cfg.get("num_experts", cfg.get("num_local_experts", 128))
        out["num_experts"] = int(experts)
        out["experts_per_token"] = int(cfg["num_experts_per_tok"])
        # Mixtral always renormalizes the chosen experts' weights; Qwen3-MoE when norm_topk_prob says so.
        out["norm_topk_prob"] = kind == "mixtral" or bool(cfg.get("norm_topk_prob", False))
        out["moe_intermediate_size"] = int(cfg["moe_intermediate_size"]) if kind == "qwen3_moe" \
            else int(cfg["intermediate_size"])
        only = set(cfg.get("mlp_only_layers") or [])
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        out["moe_layers"] = tuple(i not in only and (i + 1) % step == 0 for i in range(layers))
    return out


def _positive_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def _layer_windows(cfg: dict[str, Any], kind: str, layers: int) -> tuple[int, ...]:
    """Each layer's sliding window (0: attends to every earlier position), as the family's HF code decides."""
    window = cfg.get("sliding_window")
    if not window:
        return ()
    types = cfg.get("layer_types")
    if kind in ("mistral", "phi3", "mixtral"):  # one window for every layer, whenever the config has one
        return (int(window),) * layers
    if kind in GEMMA and not types:  # older configs: every `sliding_window_pattern`-th layer is global
        pattern = int(cfg.get("_sliding_window_pattern") or cfg["sliding_window_pattern"])
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if kind in ("qwen2", "qwen3", "qwen3_moe") and not cfg.get("use_sliding_window", False):
        return ()
    if not types:
        return ()
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def _local_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None] | None:
    """Gemma 3's sliding layers' rope (theta, scaling): from rope_parameters keyed by layer type
    (transformers 5) or rope_local_base_freq (older configs, where rope_scaling is the global layers')."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        local = params["sliding_attention"]
        scaling = None if local.get("rope_type", "default") == "default" else dict(local)
        return float(local.get("rope_theta", 10000.0)), scaling
    if "rope_local_base_freq" in cfg:
        return float(cfg["rope_local_base_freq"]), None
    return 10000.0, None


def global_rope(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """The rope parameters of the (global) layers: rope_parameters keyed by layer type carry them under
    full_attention; otherwise rope_scaling or rope_parameters themselves."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        return dict(params["full_attention"])
    scaling = cfg.get("rope_scaling") or params
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        # longrope's attention factor depends on these two top-level fields (transformers' _compute_longrope_parameters)
        scaling = {"original_max_position_embeddings": cfg.get("original_max_position_embeddings"),
                   "max_position_embeddings": cfg.get("max_position_embeddings"), **scaling, "rope_type": "longrope"}
    return dict(scaling) if isinstance(scaling, dict) else None


def refused_fields(cfg: dict[str, Any]) -> list[str]:
    """`field: why` for each field of a raw config.json whose value trtbuild cannot honour."""
    cfg = with_defaults(cfg)
    kind = cfg.get("model_type")
    problems = []
    act_field = "hidden_activation" if "hidden_activation" in cfg else "hidden_act"
    act = cfg.get(act_field, "silu")
    allowed = ("gelu_pytorch_tanh",) if kind in GEMMA else ("silu",)
    if act is not None and act not in allowed:
        problems.append(f"{act_field}: {act!r} is not supported for {kind} ({', '.join(allowed)} is)")
    for name, families in _FAMILY_ONLY.items():
        if cfg.get(name) is not None and kind not in families:
            problems.append(f"{name}: not part of the {kind} model trtbuild builds")
    if kind == "gemma3_text" and cfg.get("attn_logit_softcapping") is not None:
        problems.append("attn_logit_softcapping: Gemma 3 does not cap its attention scores (transformers ignores "
                        "the field); set it to null")
    if cfg.get("use_bidirectional_attention"):
        problems.append("use_bidirectional_attention: only causal attention is supported")
    for name in ("partial_rotary_factor",):
        value = cfg.get(name, (global_rope(cfg) or {}).get(name, 1.0))
        if value not in (None, 1, 1.0):
            problems.append(f"{name}: {value} is not supported (rope over the whole head only)")
    if cfg.get("quantization_config") and kind == "llama":
        try:  # compressed-tensors FP8 is read as stored (models/compressed.py); other schemes are named
            if fp8_scheme(cfg, Path("config.json")) is None:
                problems.append("quantization_config: pre-quantized checkpoints other than compressed-tensors FP8 "
                                "are not supported")
        except InputError as exc:
            problems.append(str(exc).removeprefix("config.json: "))
    elif cfg.get("quantization_config"):
        problems.append("quantization_config: pre-quantized checkpoints are not supported")
    types = cfg.get("layer_types")
    if types is not None and not set(types) <= {"full_attention", "sliding_attention"}:
        problems.append(f"layer_types: {sorted(set(types) - {'full_attention', 'sliding_attention'})} are not supported")
    if kind in MOE and cfg.get("shared_expert_intermediate_size"):
        problems.append("shared_expert_intermediate_size: shared experts are not supported")
    return problems


def attention_kernel_limits(cfg: Any) -> str | None:
    """Why trtbuild's decode attention kernel (kernels/decode_attention.py) cannot serve this model, or None:
    it rotates and attends the Llama way only. The build then keeps the model's ATen attention."""
    needs = [what for what, present in (
        ("norms on q and k", cfg.qk_norm), ("sliding windows", bool(cfg.layer_windows)),
        ("a query scale of its own", cfg.attn_scale is not None), ("soft-capped scores", bool(cfg.attn_softcap)),
        ("a second rope table", cfg.local_rope_theta is not None)) if present]
    return f"{cfg.model_type} needs {', '.join(needs)}, which the kernel does not do" if needs else None


def model_paths(cfg: Any) -> dict[str, str]:
    """What the engine computes each part of the family with, for the manifest (`tactics.model_paths`)."""
    paths = {"family": cfg.model_type}
    windows = sorted({w for w in cfg.layer_windows if w})
    if windows or cfg.attn_softcap:
        what = ", ".join([f"sliding window {windows}"] * bool(windows) + ["soft-capped scores"] * bool(cfg.attn_softcap))
        paths["attention"] = (f"masked ATen attention for the layers with {what} (prompt and decode); "
                              "SDPA's causal kernels for the others")
    if cfg.num_experts:
        paths["experts"] = (f"top-{cfg.experts_per_token} of {cfg.num_experts} experts: decode steps multiply the "
                            "gathered weights of the chosen experts (tactics.moe_decode: ATen's gather or the "
                            "Triton kernel); prompts run every expert, dense, the unchosen ones weighted by zero, "
                            "or grouped by expert (tactics.moe_prefill)")
    if cfg.hidden_act != "silu":
        paths["mlp_gating"] = f"{cfg.hidden_act} in ATen after the gate/up matmul"
    return paths


def unread_expert_parameters(cfg: Any, batch: int) -> float:
    """Parameters of experts that a decode step of `batch` rows need not read: at batch 1 all but the k
    chosen in each layer; at batch b, all but as many distinct experts as b tokens choosing uniformly at
    random would pick (E (1 - (1 - k/E)^b)). 0 for a dense model. Floors take the rest as a step's bytes."""
    if not cfg.num_experts:
        return 0.0
    e, k = cfg.num_experts, cfg.experts_per_token
    distinct = e * (1 - (1 - k / e) ** batch)
    return sum(cfg.moe_layers) * (e - distinct) * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def token_matmul_flops(cfg: Any) -> float:
    """The projections' and MLPs' FLOPs for one token through every layer (a mixture of experts' layer: its k
    chosen experts), without attention over the context and without the head."""
    c = cfg
    per_layer = c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim + c.num_heads * c.head_dim * c.hidden_size
    moe = sum(getattr(c, "moe_layers", ()))
    mlps = 3 * c.hidden_size * ((c.num_layers - moe) * c.intermediate_size
                                + moe * getattr(c, "experts_per_token", 0) * getattr(c, "moe_intermediate_size", 0))
    return 2.0 * (per_layer * c.num_layers + mlps)


def windows_within(cfg: Any, max_seq_len: int) -> Any:
    """`cfg` without the sliding windows that no position below max_seq_len can outgrow (a window of W hides
    slot j from position p only when j <= p - W, so never where p < W): an engine of Mistral's 4096-token
    window and max_seq_len 4096 attends as Llama does, through the same kernels."""
    from dataclasses import replace

    windows = tuple(w if w < max_seq_len else 0 for w in cfg.layer_windows)
    return replace(cfg, layer_windows=windows if any(windows) else ())


def fp8_scheme(raw: dict[str, Any], where: Path) -> str | None:
    """"channel" or "tensor" for a compressed-tensors checkpoint of 8-bit float weights; None for a checkpoint
    that is not compressed-tensors. Raises InputError for a compressed-tensors scheme trtbuild does not read."""
    q = raw.get("quantization_config") or raw.get("compression_config")
    if not isinstance(q, dict) or q.get("quant_method") != "compressed-tensors":
        return None
    groups = q.get("config_groups") or {}
    weights = [g.get("weights") or {} for g in groups.values() if isinstance(g, dict)]
    if (len(weights) == 1 and weights[0].get("num_bits") == 8 and weights[0].get("type") == "float"
            and weights[0].get("strategy") in ("channel", "tensor")):
        return str(weights[0]["strategy"])
    raise InputError(f"{where}: quantization_config: compressed-tensors with weights {weights!r} is not supported; "
                     "trtbuild reads 8-bit float weights with per-channel or per-tensor scales (FP8, FP8_DYNAMIC)")
