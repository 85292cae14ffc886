"""A Llama-family decoder with a static KV cache (Llama 2/3, Mistral, Qwen2; GQA and MQA).

Written to be exported: no data-dependent control flow, the KV cache is a set of registered buffers
updated in place, and the attention mask is computed from positions rather than stored. Q/K/V and
gate/up projections are fused into one matmul each (fewer, larger kernels);
`checkpoint.convert_hf_state_dict` maps a Hugging Face checkpoint onto this layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trtbuild.kernels.fusions import NORMED
from trtbuild.models.families import family_fields, global_rope, with_defaults
from trtbuild.models.moe import MoE


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    # Features of the other families (models/families.py sets them from config.json); the defaults are Llama's.
    model_type: str = "llama"
    qk_norm: bool = False  # RMSNorm over each head's query and key before rope (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma)
    unit_offset_norms: bool = False  # the checkpoint stores RMSNorm gains as gain - 1 (Gemma)
    hidden_act: str = "silu"  # the MLP's gating: "silu" or "gelu_tanh"
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window, 0 for none; () for none anywhere
    local_rope_theta: float | None = None  # sliding layers' own rope (Gemma 3); None: every layer shares one
    local_rope_scaling: dict[str, Any] | None = None
    num_experts: int = 0  # a mixture of experts in the layers `moe_layers` marks (models/moe.py)
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the chosen experts' weights renormalized to sum to one
    moe_layers: tuple[bool, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "LlamaConfig":
        """Read a Hugging Face config.json; raises KeyError/TypeError for the loader to report."""
        cfg = with_defaults(cfg)  # what transformers assumes of the fields the family's config leaves out
        heads = int(cfg["num_attention_heads"])
        model_type = cfg.get("model_type", "llama")
        attention_bias = bool(cfg.get("attention_bias", False))
        scaling = global_rope(cfg)
        # transformers 5 writes rope_theta inside rope_parameters; read it before a "default" rope
        # type drops the mapping, or a checkpoint's rope_theta would silently become 10000.
        theta = cfg.get("rope_theta", (scaling or {}).get("rope_theta", 10000.0))
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=dict(scaling) if scaling else None,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 puts biases on q/k/v only; Llama's attention_bias covers q/k/v and o.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            **family_fields(cfg),
        )

    def num_parameters(self, active: bool = False) -> int:
        """Every parameter but biases; `active`: with only the chosen experts of a mixture of experts (what
        one token reads)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = d * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        per_layer = qkv + self.num_heads * self.head_dim * d + 2 * d
        per_layer += 2 * self.head_dim * self.qk_norm + 2 * d * self.sandwich_norms
        experts = self.experts_per_token if active else self.num_experts
        moe = experts * 3 * d * self.moe_intermediate_size + self.num_experts * d  # the experts and the router
        mlps = sum(moe if self.moe_layers and self.moe_layers[i] else 3 * d * f for i in range(self.num_layers))
        return self.num_layers * per_layer + mlps + v * d * (1 if self.tie_word_embeddings else 2) + d


def rope_frequencies(cfg: LlamaConfig) -> Tensor:
    """Inverse frequencies of rotary embeddings, with Llama-3 scaling when the config asks."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    s = cfg.rope_scaling
    if s is None:
        return inv.float()
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return (inv / float(s["factor"])).float()
    if kind == "longrope":
        longrope_frequencies(cfg, "long_factor")  # checked here, with the config, not first at a build's rope table
        return longrope_frequencies(cfg, "short_factor")
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3 and longrope are)")
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()


def longrope_frequencies(cfg: LlamaConfig, which: str) -> Tensor:
    """LongRoPE's (Phi-3) inverse frequencies with its short or long factors, as transformers computes them."""
    s = cfg.rope_scaling or {}
    factors = torch.tensor([float(f) for f in s[which]], dtype=torch.float32)
    if factors.shape != (cfg.head_dim // 2,):
        raise ValueError(f"{which} has {factors.numel()} entries, the head dimension needs {cfg.head_dim // 2}")
    exponents = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim
    return 1.0 / (factors * cfg.rope_theta ** exponents)


def _longrope_scale(s: dict[str, Any]) -> float:
    """The factor LongRoPE multiplies cos and sin by (transformers' attention_factor)."""
    old = float(s["original_max_position_embeddings"])
    factor = s.get("factor") or float(s["max_position_embeddings"]) / old
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old))


def _cos_sin(cfg: LlamaConfig, max_seq_len: int) -> Tensor:
    positions = torch.arange(max_seq_len, dtype=torch.float32)
    angles = torch.outer(positions, rope_frequencies(cfg))
    s = cfg.rope_scaling
    if s is None or s.get("rope_type") != "longrope":
        return torch.stack([angles.cos(), angles.sin()], dim=-1)
    # transformers rotates with the long factors once a forward's last position reaches
    # original_max_position_embeddings, so a decode step at position p uses them iff p >= that length; here
    # per position, so a prompt crossing that length keeps the short factors below it (docs/models.md)
    long = torch.outer(positions, longrope_frequencies(cfg, "long_factor"))
    angles = torch.where(positions[:, None] >= float(s["original_max_position_embeddings"]), long, angles)
    scale = _longrope_scale(s)
    return torch.stack([angles.cos() * scale, angles.sin() * scale], dim=-1)


def rope_table(cfg: LlamaConfig, max_seq_len: int) -> Tensor:
    """(max_seq_len, head_dim // 2, 2) cos/sin table, kept in fp32 for accuracy; (..., 4) where the sliding
    layers rotate with a rope of their own (Gemma 3): the global layers' cos/sin, then theirs."""
    table = _cos_sin(cfg, max_seq_len)
    if cfg.local_rope_theta is None:
        return table
    local = replace(cfg, rope_theta=cfg.local_rope_theta, rope_scaling=cfg.local_rope_scaling, local_rope_theta=None)
    return torch.cat([table, _cos_sin(local, max_seq_len)], dim=-1)


def apply_rope(x: Tensor, table: Tensor) -> Tensor:
    """Rotate (B, T, H, D) by a (B or 1, T, D/2, 2) table (each row's own positions, or one set for the
    batch), in the half-split layout Hugging Face uses."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    table = table if table.dim() == 4 else table[None]  # (T, D/2, 2): one set of positions
    cos, sin = table[:, :, None, :, 0], table[:, :, None, :, 1]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


def kv_cache_shape(cfg: LlamaConfig, max_batch_size: int, max_seq_len: int) -> tuple[int, int, int, int]:
    """(rows, KV heads, slots, D) of each layer's K and V cache.

    One row more than max_batch_size: the scratch row (`scratch_row`), which the padding rows of a decode
    batch write into, so that a bucket's unused rows never touch a sequence's cache (a decode step serves
    any set of rows, each at its own position: `Transformer.forward`'s `slots`). One slot more than
    max_seq_len, never written: a span of max_seq_len slots is then never the whole dimension, so the
    decode graph exported with a dynamic span has one code path; with slots == max_seq_len, export adds a
    contiguity branch for span == slots (and a runtime assert that refuses the longest window)."""
    return (max_batch_size + 1, cfg.num_kv_heads, max_seq_len + 1, cfg.head_dim)


def scratch_row(max_batch_size: int) -> int:
    """The cache row no sequence owns: a decode batch's padding rows read and write only there."""
    return max_batch_size


class RMSNorm(nn.Module):
    # True once `Transformer.fold_norm_gains` has moved the gain into the weights after the norm: the
    # weight is then ones, and a decode kernel doing the norm reads no gain.
    folded: bool = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


FOLDED = {"norm": "rms", "norm_gate": "rms_gate"}


class Linear(nn.Linear):
    """nn.Linear that a decode graph can route through trtbuild's decode matmul kernel.

    It is called with the operations around it in the block (the RMSNorm before it, the SiLU gating of
    its output's halves, the residual add after it), which it applies itself: in ATen ops by default,
    inside the kernel when the backend routes it there. `fusion` says which of these its call site
    passes (one of `kernels.fusions.FUSIONS`), so the build can time the kernel as it will run.

    `decode_config` (a `matmul_configs.MatmulConfig`, None by default) is set by the backend only while
    it exports a decode graph, for the weight shapes where the build's tactic selection measured the
    kernel faster than cuBLAS; `decode_fusion` then says what of its call site's fusion the kernel does
    ("none" but with options.decode_fusion fused or epilogue, never with a bias; what the kernel does not
    do is applied around it). Prefill and every CPU build keep F.linear.
    The weight stays the module's own parameter, so the state dict and the runtime constants are
    unchanged."""

    decode_config: Any = None
    decode_fusion: str = "none"
    # The stored weight format (`quantize.FORMATS`: fp8, int8, int4) once `hold_quantized` has replaced the
    # weight by the buffers `qweight`, `scale` (and int4's `zero`); None for a dense weight. On the CPU the
    # graphs dequantize and multiply in the activations' dtype (correct, not fast).
    quant: str | None = None
    # Set by the backend only while it exports a CUDA prefill graph of an fp8 engine: the matmul runs in fp8
    # on the tensor cores (`quantize.fp8_linear`, per-token activation scales) instead of dequantizing.
    fp8_prefill: bool = False

    def __init__(self, in_features: int, out_features: int, bias: bool, fusion: str = "none") -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.fusion = fusion

    def hold_quantized(self, fmt: str) -> None:
        """Replace the weight parameter by empty buffers of format `fmt` on its device (meta while a model
        is placed), for `load_state_dict(..., assign=True)` to fill with a quantized checkpoint's tensors."""
        from trtbuild.models.quantize import stored_shapes

        device = self.weight.device
        del self.weight
        for name, (shape, dtype) in stored_shapes(fmt, self.out_features, self.in_features).items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))
        self.quant = fmt

    def dense_weight(self, dtype: torch.dtype) -> Tensor:
        """The weight as a dense (out, in) matrix in `dtype`: dequantized when the Linear holds it quantized."""
        if self.quant is None:
            return self.weight.to(dtype)
        from trtbuild.models.quantize import dequantize

        return dequantize(self.quant, self.qweight, self.scale, getattr(self, "zero", None), dtype)

    def _matmul(self, x: Tensor) -> Tensor:
        """x @ W^T + b, W as the Linear holds it."""
        if self.quant is None:
            return super().forward(x)
        if self.fp8_prefill:
            from trtbuild.models.quantize import fp8_linear

            return fp8_linear(x, self.qweight, self.scale, self.bias)
        return F.linear(x, self.dense_weight(x.dtype), self.bias)

    def forward(self, x: Tensor, norm: RMSNorm | None = None, gate: bool = False, residual: Tensor | None = None) -> Tensor:
        inside = self.decode_fusion  # what the kernel does ("none" whenever decode_config is None)
        if norm is not None and inside not in NORMED:
            x, norm = norm(x), None
        if inside != "none":  # the kernel with (part of) the fusion; a fused Linear never has a bias
            in_gate, in_residual = "gate" in inside, "residual" in inside
            y = self._kernel(x, norm, gate and in_gate, residual if in_residual else None)
            gate, residual = gate and not in_gate, None if in_residual else residual
        elif self.decode_config is None:
            y = self._matmul(x)
        else:
            y = self._kernel(x)
            y = y if self.bias is None else y + self.bias
        if gate:
            a, b = y.chunk(2, dim=-1)
            y = F.silu(a) * b
        return y if residual is None else residual + y

    def _kernel(self, x: Tensor, norm: RMSNorm | None = None, gate: bool = False, residual: Tensor | None = None) -> Tensor:
        """trtbuild's decode matmul with `decode_config`, doing whichever of norm, gate and residual it is given
        (a quantized Linear: the quantized kernel, which does the gating and the residual add, never the norm)."""
        c = self.decode_config
        flat_residual = None if residual is None else residual.reshape(-1, residual.shape[-1])
        if self.quant is not None:
            from trtbuild.kernels.quant_matmul import quant_matmul_op  # needs Triton: CUDA builds only

            y = quant_matmul_op(x.reshape(-1, self.in_features), self.qweight, self.scale, getattr(self, "zero", None),
                                c.block_n, c.block_k, c.warps, c.stages, c.split, gate, flat_residual)
            return y.view(*x.shape[:-1], y.shape[-1])
        from trtbuild.kernels.decode_matmul import decode_matmul_op  # needs Triton: CUDA builds only

        gain = None if norm is None or norm.folded else norm.weight
        y = decode_matmul_op(x.reshape(-1, self.in_features), self.weight, gain, flat_residual,
                             0.0 if norm is None else norm.eps, gate, c.block_n, c.block_k, c.warps, c.stages,
                             c.split, norm is not None)
        return y.view(*x.shape[:-1], y.shape[-1])


class Attention(nn.Module):
    # Set by the backend only while it exports a decode graph that uses trtbuild's decode attention
    # kernel (options.decode_attention): "kernel" (rope, the cache writes and attention in one custom op).
    # Prefill, CPU builds and eager runs keep "aten": `_cached_attention`.
    decode_kernel: str = "aten"
    # Set by the backend only while it exports the prefill graph: "sdpa" or "cudnn" (causal_attention).
    prefill_kernel: str = "sdpa"

    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.wqkv = Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias, fusion="norm")
        # with norms after attention (Gemma) the residual is added after that norm, by the block
        self.wo = Linear(q, cfg.hidden_size, bias=cfg.o_bias, fusion="none" if cfg.sandwich_norms else "residual")
        self.window = cfg.layer_windows[layer] if cfg.layer_windows else 0  # 0: no sliding window
        self.rope_pair = 1 if self.window and cfg.local_rope_theta is not None else 0  # which cos/sin of the table
        self.qk_norms = (RMSNorm(cfg.head_dim, cfg.rms_norm_eps), RMSNorm(cfg.head_dim, cfg.rms_norm_eps)) \
            if cfg.qk_norm else None
        if self.qk_norms is not None:
            self.q_norm, self.k_norm = self.qk_norms
        # what SDPA's causal kernels cannot do: a prompt's attention takes the masked path for these layers
        self.masked = bool(self.window or cfg.attn_softcap)

    def forward(self, x: Tensor, rope: Tensor, table: Tensor, pos: Tensor, slots: Tensor, k_cache: Tensor,
                v_cache: Tensor, from_start: bool, span: Tensor | None, norm: RMSNorm, residual: Tensor) -> Tensor:
        """residual + attention(norm(x)): the norm and the add are the projections' (see Linear).
        `rope` is the whole (max_seq_len, D/2, 2) table, `table` its rows at `pos` (B or 1, T); `slots` (B,)
        the cache row of each sequence."""
        c = self.cfg
        b, t, _ = x.shape
        q_size = c.num_heads * c.head_dim
        qkv = self.wqkv(x, norm=norm)
        if not isinstance(slots, Tensor):  # a mixed paged step's rows (models/paged.MixedRows), caches its pools
            return self.wo(slots.attend(self, qkv, table, k_cache, v_cache), residual=residual)
        if slots.dim() == 2:  # block tables: the paged KV cache (models/paged.py), caches are its pools
            return self.wo(paged_attention(self, qkv, table, pos, slots, k_cache, v_cache), residual=residual)
        if self.decode_kernel == "kernel":
            from trtbuild.kernels.decode_attention import decode_attention_rope_op  # needs Triton: CUDA builds only

            y = decode_attention_rope_op(qkv, rope, k_cache, v_cache, pos.expand(b, 1).reshape(b).contiguous(), slots,
                                         c.num_heads)
            return self.wo(y.reshape(b, t, q_size), residual=residual)
        if c.local_rope_theta is not None:
            table = table[..., 2 * self.rope_pair:2 * self.rope_pair + 2]
        q_rows, k, v = rope_and_store(qkv, table, pos, slots, k_cache, v_cache, c, self.qk_norms)
        q = q_rows.transpose(1, 2)
        # A prompt that starts at position 0 only attends to itself: a causal fused kernel over t
        # tokens, not a masked pass over the whole cache.
        if from_start and self.masked:  # a sliding window or soft-capped scores: the prompt's keys, masked
            y = _cached_attention(q, k, v, pos, None, c.attn_scale, c.attn_softcap, self.window)
        elif from_start:
            y = causal_attention(q, k, v, self.prefill_kernel, c.attn_scale)
        else:
            # the window first, then the sequences' rows: the gather copies only the slots attended over
            w = k_cache.shape[2] if span is None else span.shape[0]
            keys, values = k_cache[:, :, :w].index_select(0, slots), v_cache[:, :, :w].index_select(0, slots)
            y = _cached_attention(q, keys, values, pos, span, c.attn_scale, c.attn_softcap, self.window)
        return self.wo(y.transpose(1, 2).reshape(b, t, q_size), residual=residual)


def rope_and_store(qkv: Tensor, table: Tensor, pos: Tensor, slots: Tensor, k_cache: Tensor, v_cache: Tensor,
                   c: LlamaConfig, qk_norms: tuple[RMSNorm, RMSNorm] | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Split the QKV projection's output (B, T, (H + 2 KV) D), rotate the query and the keys by `table`
    (rope's rows at `pos`, (B or 1, T)) and write the keys and values into the caches' rows `slots` (B,) at
    `pos`. Returns the query (B, T, H, D) and the new keys and values (B, KV, T, D). What the decode
    attention kernel does itself with options.decode_attention kernel."""
    b, t, _ = qkv.shape
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(b, t, c.num_heads, c.head_dim), k.view(b, t, c.num_kv_heads, c.head_dim)
    if qk_norms is not None:  # Qwen3, Gemma 3: each head's query and key normed before rope
        q, k = qk_norms[0](q), qk_norms[1](k)
    q_rows = apply_rope(q, table)
    k = apply_rope(k, table).transpose(1, 2)
    v = v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
    # In-place writes into the static cache: export keeps these as buffer mutations, so the
    # prefill and decode graphs share one cache. Indexed on the whole buffer, never through a
    # slice of it: a write into `k_cache[:b]` with b < max_batch_size became a copy of the whole
    # slice (measured on the H200: 2 x 3.5 us per layer for batch-1 decode, 13% of the step).
    slot = (slots[:, None, None], torch.arange(c.num_kv_heads, device=qkv.device)[None, :, None], pos[:, None, :])
    k_cache.index_put_(slot, k)
    v_cache.index_put_(slot, v)
    return q_rows, k, v


def causal_attention(q: Tensor, k: Tensor, v: Tensor, kernel: str = "sdpa", scale: float | None = None) -> Tensor:
    """Causal attention of a prompt over itself: q (B, H, T, D), k and v (B, KV, T, D) -> (B, H, T, D).
    "sdpa": SDPA's dispatch (FlashAttention-2 first on CUDA); "cudnn": cuDNN's fused attention, called
    directly (CUDA only; SDPA ranks it fourth); the build times both (backends/prefill_attention.py).
    Both take the KV heads as they are (GQA): repeating them would put the shape guards of the repeat's
    view arithmetic on the dynamic prompt length, which export cannot discharge on CUDA.
    `scale`: the scores' factor where the family sets one (Gemma); None is 1/sqrt(D)."""
    if kernel == "cudnn":
        # (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask)
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, True, False,
                                                                   scale=scale)[0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1], scale=scale)


def _cached_attention(q: Tensor, keys: Tensor, values: Tensor, pos: Tensor, span: Tensor | None,
                      scale: float | None = None, softcap: float | None = None, window: int = 0) -> Tensor:
    """Attention of q (B, H, T, D) at positions `pos` (B or 1, T) over the sequences' caches (B, KV, S, D).

    `span` (W,) = arange(W) limits it to the first W slots, which must cover every position in
    `pos`: a decode graph exported with W dynamic reads only the filled part of the cache, not all
    max_seq_len slots (at batch 8 and 4096 slots, the whole cache of an 8B model is 4.3 GB a step,
    a quarter of its weights). None means the whole cache.

    The query heads that share a KV head are stacked into one matrix, so each step reads every cached
    K and V row once. Repeating K/V per query head instead (what SDPA's math path does for GQA) writes
    and reads H/KV copies of the cache every step: 4x the cache traffic on Llama-3 shapes, measured on
    the H200 as most of the gap between batch-8 decode and its floor.

    `scale` (None: 1/sqrt(D)), `softcap` (scores -> softcap * tanh(scores / softcap)) and `window` (slot j
    visible to position p only if p - window < j, as transformers' sliding_window_overlay) are the other
    families' (models/families.py).
    """
    b, h, t, d = q.shape
    pos = pos if pos.dim() == 2 else pos[None, :]  # (T,): one set of positions for every sequence
    if span is None:
        span = torch.arange(keys.shape[2], device=q.device)
    keys, values = keys[:, :, : span.shape[0]], values[:, :, : span.shape[0]]
    kv = keys.shape[1]
    rep = h // kv
    qg = q.reshape(b, kv, rep * t, d)  # query head i uses KV head i // rep (HF's repeat_kv order)
    scores = (qg @ keys.transpose(-1, -2)).float() * (d**-0.5 if scale is None else scale)  # (B, KV, rep*T, W)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    # Causal mask over the static cache, from each row's positions: slot j is visible to position p iff j <= p.
    visible = (span[None, None, :] <= pos[:, :, None]).repeat(1, rep, 1)[:, None]  # (B or 1, 1, rep*T, W)
    if window:
        visible = visible & (span[None, None, :] > pos[:, :, None] - window).repeat(1, rep, 1)[:, None]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).to(q.dtype)
    return (probs @ values).reshape(b, h, t, d)


def paged_kernel(cfg: LlamaConfig, pool: Tensor) -> bool:
    """Whether the paged attention reads the pools through trtbuild's Triton kernel (kernels/paged_attention.py):
    on CUDA, with Triton, for the models and dtypes it serves. Decided while the paged graph is traced, from
    the pools' device; the CPU (and a CUDA model the kernel does not serve) keeps the ATen gather below."""
    if pool.device.type != "cuda":
        return False
    try:
        from trtbuild.kernels.paged_attention import supports
    except ImportError:  # no Triton: a CPU-only install's torch, or a wheel without it
        return False
    return supports(cfg, pool.dtype) is None


def paged_attention(attn: Any, qkv: Tensor, table: Tensor, pos: Tensor, blocks: Tensor, k_pool: Tensor,
                    v_pool: Tensor) -> Tensor:
    """Attention through the paged KV cache (models/paged.py): `attn` over the QKV projection (B, T,
    (H + 2 KV) D) of tokens at positions `pos` (B, T), rope's rows `table` at those positions; `blocks` (B, N)
    each sequence's block table, N blocks covering every position in `pos`. Writes the keys and values into
    the pools; returns (B, T, H D)."""
    c = attn.cfg
    b, t, _ = qkv.shape
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(b, t, c.num_heads, c.head_dim), k.view(b, t, c.num_kv_heads, c.head_dim)
    v = v.view(b, t, c.num_kv_heads, c.head_dim)
    if attn.qk_norms is not None:
        q, k = attn.qk_norms[0](q), attn.qk_norms[1](k)
    if c.local_rope_theta is not None:
        table = table[..., 2 * attn.rope_pair:2 * attn.rope_pair + 2]
    q, k = apply_rope(q, table), apply_rope(k, table)
    size = k_pool.shape[2]
    where = (blocks.gather(1, pos // size)[:, :, None], torch.arange(c.num_kv_heads, device=qkv.device)[None, None, :],
             (pos % size)[:, :, None])
    k_pool.index_put_(where, k)
    v_pool.index_put_(where, v)
    if paged_kernel(c, k_pool):
        from trtbuild.kernels.paged_attention import paged_attention_op

        scale = c.head_dim**-0.5 if c.attn_scale is None else c.attn_scale
        y = paged_attention_op(q, k_pool, v_pool, pos, blocks, scale)
        return y.reshape(b, t, q_size)
    n = blocks.shape[1]
    # The sequence's blocks side by side, (B, KV, N * BLOCK, D): slot j holds position j. Masked past each
    # query's own position, so blocks not yet written (and a padded table's entries) are never seen.
    keys = k_pool.index_select(0, blocks.reshape(-1)).view(b, n, c.num_kv_heads, size, c.head_dim)
    values = v_pool.index_select(0, blocks.reshape(-1)).view(b, n, c.num_kv_heads, size, c.head_dim)
    keys = keys.transpose(1, 2).reshape(b, c.num_kv_heads, n * size, c.head_dim)
    values = values.transpose(1, 2).reshape(b, c.num_kv_heads, n * size, c.head_dim)
    span = torch.arange(n * size, device=qkv.device)
    y = _cached_attention(q.transpose(1, 2), keys, values, pos, span, c.attn_scale, c.attn_softcap, attn.window)
    return y.transpose(1, 2).reshape(b, t, q_size)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        # The decode matmul kernel gates with SiLU only: a GELU family's gating stays in ATen after it, and
        # with norms after the MLP (Gemma) the residual is the block's to add.
        self.gelu = cfg.hidden_act == "gelu_tanh"
        self.w13 = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias,
                          fusion="norm" if self.gelu else "norm_gate")
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias,
                         fusion="none" if cfg.sandwich_norms else "residual")

    def forward(self, x: Tensor, norm: RMSNorm, residual: Tensor | None) -> Tensor:
        """residual + w2(silu(gate) * up), [gate | up] = w13(norm(x)); GELU-tanh in place of SiLU for Gemma."""
        if self.gelu:
            a, b = self.w13(x, norm=norm).chunk(2, dim=-1)
            return self.w2(F.gelu(a, approximate="tanh") * b, residual=residual)
        return self.w2(self.w13(x, norm=norm, gate=True), residual=residual)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention = Attention(cfg, layer)
        self.moe = bool(cfg.moe_layers) and cfg.moe_layers[layer]
        self.feed_forward: nn.Module = MoE(cfg) if self.moe else FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:  # Gemma: each sublayer's output normed before the residual add
            self.post_attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, rope: Tensor, table: Tensor, pos: Tensor, slots: Tensor, k_cache: Tensor,
                v_cache: Tensor, from_start: bool, span: Tensor | None) -> Tensor:
        if self.sandwich:
            a = self.attention(x, rope, table, pos, slots, k_cache, v_cache, from_start, span, self.attention_norm, None)
            h = x + self.post_attention_norm(a)
            return h + self.post_ffn_norm(self.feed_forward(h, self.ffn_norm, None))
        h = self.attention(x, rope, table, pos, slots, k_cache, v_cache, from_start, span, self.attention_norm, x)
        if self.moe:  # a decode step reads only the chosen experts' weights (models/moe.py)
            return self.feed_forward(h, self.ffn_norm, h, gathered=not from_start)
        return self.feed_forward(h, self.ffn_norm, h)


class Transformer(nn.Module):
    """forward(tokens (B, T) int64, input_pos (T,) or (B, T) int64) -> logits (B, V) of the last position.

    input_pos (T,) is one set of positions for the whole batch; (B, T) gives each row its own (a decode
    step of a ragged batch: (B, 1), every sequence at its own length). `slots` (B,) names the cache row of
    each sequence (default: rows 0..B-1), so a step can serve any set of sequences in any order.

    Only the last position goes through the LM head: generation needs nothing else, and for long
    prompts the head is a large share of prefill's FLOPs. `all_logits=True` is for tests.
    `from_start=True` promises input_pos == arange(T) (a prompt), which allows causal attention over
    the prompt alone; the KV cache is filled either way.
    """

    rope: Tensor  # a registered buffer

    def __init__(self, cfg: LlamaConfig, max_batch_size: int, max_seq_len: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        for block in self.layers:  # a window no position here outgrows masks nothing: SDPA's causal kernel serves
            if block.attention.window >= max_seq_len:
                block.attention.window, block.attention.masked = 0, bool(cfg.attn_softcap)
        self.embed_scale = embed_scale(cfg, dtype)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, fusion="norm")
        self.register_buffer("rope", rope_table(cfg, max_seq_len), persistent=False)
        shape = kv_cache_shape(cfg, max_batch_size, max_seq_len)
        for i in range(cfg.num_layers):
            self.register_buffer(f"k_cache_{i}", torch.zeros(shape, dtype=dtype), persistent=False)
            self.register_buffer(f"v_cache_{i}", torch.zeros(shape, dtype=dtype), persistent=False)

    @torch.no_grad()
    def fold_norm_gains(self) -> None:
        """Move each RMSNorm's gain into the weight of the matmul after it: rmsnorm(x; g) @ W^T equals
        rmsnorm(x; 1) @ (W diag g)^T, so a decode matmul that does the norm itself (fusions rms and
        rms_gate) needs neither the gain's loads nor a multiply per element. The norm keeps its weight,
        as ones, so every graph (prefill too) computes the same thing on the folded weights. Rounding:
        W * g is rounded to the weights' dtype once, where the model rounds the normed activations
        times g at every call. A tied LM head is the embedding table, which the final norm's gain must
        not change: that norm keeps its gain."""
        blocks: list[Block] = list(self.layers)  # type: ignore[arg-type]  # ModuleList items are Modules to mypy
        pairs: list[tuple[RMSNorm, Linear]] = [(b.attention_norm, b.attention.wqkv) for b in blocks]
        pairs += [(b.ffn_norm, b.feed_forward.w13) for b in blocks if isinstance(b.feed_forward, FeedForward)]
        if not self.cfg.tie_word_embeddings:
            pairs.append((self.norm, self.output))
        for norm, linear in pairs:
            linear.weight.copy_(linear.weight.float() * norm.weight.float()[None, :])
            norm.weight.fill_(1.0)
            norm.folded = True
            linear.fusion = FOLDED[linear.fusion]

    def forward(self, tokens: Tensor, input_pos: Tensor, all_logits: bool = False, from_start: bool = False,
                span: Tensor | None = None, slots: Any = None, pools: list[Tensor] | None = None) -> Tensor:
        pos = positions(input_pos)
        if slots is None:
            slots = torch.arange(tokens.shape[0], device=tokens.device)
        table = self.rope[pos]
        x = embed(self.tok_embeddings, self.embed_scale, tokens)
        for i, layer in enumerate(self.layers):
            # `pools` (models/paged.py): each layer's K and V block pools, with `slots` the block tables (B, N)
            k_cache, v_cache = (pools[2 * i], pools[2 * i + 1]) if pools is not None else \
                (getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}"))
            x = layer(x, self.rope, table, pos, slots, k_cache, v_cache, from_start, span)
        if not isinstance(slots, Tensor):  # a mixed paged step: its rows' last tokens (models/paged.MixedRows)
            x = slots.lasts(x)
        if all_logits:
            return softcap(self.output(x, norm=self.norm), self.cfg.final_softcap)
        return head(self.norm, self.output, self.cfg.final_softcap, x, input_pos, from_start)


def positions(input_pos: Tensor) -> Tensor:
    """(B or 1, T): a prompt's one set of positions (T,) for every row, or each row's own (B, T)."""
    return input_pos if input_pos.dim() == 2 else input_pos[None, :]


def embed(table: nn.Module | Tensor, scale: float, tokens: Tensor) -> Tensor:
    """The tokens' embeddings, times the family's scale (`embed_scale`): through the embedding module (a
    tensor-parallel rank's looks up its shard of the vocabulary), or its weight alone (a regional graph's
    runtime, which holds the weight)."""
    x = F.embedding(tokens, table) if isinstance(table, Tensor) else table(tokens)
    return x * scale if scale != 1.0 else x


def embed_scale(cfg: LlamaConfig, dtype: torch.dtype) -> float:
    """Gemma scales the embeddings by sqrt(hidden_size) rounded to the weights' dtype, as transformers does."""
    return float(torch.tensor(cfg.embed_scale, dtype=dtype, device="cpu"))


def head(norm: RMSNorm, output: Linear, cap: float | None, x: Tensor, input_pos: Tensor, from_start: bool) -> Tensor:
    """The logits (B, V) of each row's last position: a prompt's last real row (`prompt_end`), else the last."""
    if from_start:  # a decode step's graph stays as it was: its compiled form is keyed by its program
        x = x.index_select(1, prompt_end(input_pos) - 1)
    return softcap(output(x[:, -1], norm=norm), cap)


def softcap(logits: Tensor, cap: float | None) -> Tensor:
    """cap * tanh(logits / cap) where the family caps its logits (Gemma 2; Gemma 3 where the config says)."""
    return logits if not cap else torch.tanh(logits / cap) * cap


def prompt_end(input_pos: Tensor) -> Tensor:
    """(1,): how many of the T rows handed to a prefill are the prompt's, so that a captured prefill graph
    of T tokens can serve a shorter prompt padded to T (backends/prefill_graphs.py). The prompt's rows sit
    at positions 0..t-1 and the padding after them at max_seq_len - 1. Then the padding writes only cache
    slot max_seq_len - 1, which no decode step reads before writing it itself (a step at position p reads
    slots 0..p); the causal prompt attention keeps every prompt row blind to the padding after it; and the
    prompt's rows are exactly those whose position is their index (a padded graph has at most
    max_seq_len - 1 rows, so no padding row's index reaches its position). Unpadded, this is T."""
    return (input_pos == torch.arange(input_pos.shape[0], device=input_pos.device)).sum().reshape(1)


class Step(nn.Module):
    """One exported entry point over a shared Transformer: a prompt (`from_start`) or a decode step.

    Both wrap the same module, so their constants carry the same names ("model.<param>") and one set
    of weight and cache tensors serves every package. Inputs: the tokens (B, T), their positions ((T,)
    for a prompt, (B, 1) for a decode step: each row at its own), the cache row of each sequence (B,),
    and for a decode step the span of cache slots to attend over, whose length is the graph's one dynamic
    dimension. Both return the greedy next token (B, 1) and the logits (B, V) it was taken from. The
    argmax is compiled into the graph (ATen's argmax over a 128K vocabulary took 35 us of every H200
    decode step as a separate kernel), in two reductions (`greedy_token`); the logits are there for
    sampling (trtbuild/sampling.py), which runs after the graph on the same device. Returning them adds
    no work to a greedy step: the LM head writes them to memory for the argmax either way.
    """

    def __init__(self, model: Transformer, from_start: bool) -> None:
        super().__init__()
        self.model = model
        self.from_start = from_start

    def forward(self, tokens: Tensor, input_pos: Tensor, slots: Tensor, span: Tensor | None = None) -> tuple[Tensor, Tensor]:
        logits = self.model(tokens, input_pos, from_start=self.from_start, span=span, slots=slots)
        return greedy_token(logits), logits


ARGMAX_CHUNK = 2048


def greedy_token(logits: Tensor) -> Tensor:
    """argmax(logits, -1, keepdim=True) in two reductions: the maximum of each chunk of 2048 logits, then
    of the chunks. Inductor compiles one argmax over a row as one program per row: at batch 1 a single
    program walked the 128K vocabulary, 29.5 us of a 1.1 ms 1B decode step on the H200 (RESULTS.md,
    H200). Chunked, the first reduction has a program per chunk. Same index as argmax, ties
    included: the first chunk holding the maximum, the first index inside it."""
    b, v = logits.shape
    chunks = -(-v // ARGMAX_CHUNK)
    padded = F.pad(logits, (0, chunks * ARGMAX_CHUNK - v), value=float("-inf")).view(b, chunks, ARGMAX_CHUNK)
    best, where = padded.max(-1)  # (B, chunks)
    chunk = best.argmax(-1, keepdim=True)
    return chunk * ARGMAX_CHUNK + where.gather(-1, chunk)
