"""A Llama-family decoder with a static KV cache (Llama 2/3, Mistral, Qwen2; GQA and MQA).

Written to be exported: no data-dependent control flow, the KV cache is a set of registered buffers
updated in place, and the attention mask is computed from positions rather than stored. Q/K/V and
gate/up projections are fused into one matmul each (fewer, larger kernels);
`checkpoint.convert_hf_state_dict` maps a Hugging Face checkpoint onto this layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from trtbuild.kernels.fusions import NORMED


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

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "LlamaConfig":
        """Read a Hugging Face config.json; raises KeyError/TypeError for the loader to report."""
        heads = int(cfg["num_attention_heads"])
        model_type = cfg.get("model_type", "llama")
        attention_bias = bool(cfg.get("attention_bias", False))
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
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
        )

    def num_parameters(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = d * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        per_layer = qkv + self.num_heads * self.head_dim * d + 3 * d * f + 2 * d
        return self.num_layers * per_layer + v * d * (1 if self.tie_word_embeddings else 2) + d


def rope_frequencies(cfg: LlamaConfig) -> Tensor:
    """Inverse frequencies of rotary embeddings, with Llama-3 scaling when the config asks."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    s = cfg.rope_scaling
    if s is None:
        return inv.float()
    kind = s.get("rope_type", s.get("type"))
    if kind == "linear":
        return (inv / float(s["factor"])).float()
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear and llama3 are)")
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()


def rope_table(cfg: LlamaConfig, max_seq_len: int) -> Tensor:
    """(max_seq_len, head_dim // 2, 2) cos/sin table, kept in fp32 for accuracy."""
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), rope_frequencies(cfg))
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: Tensor, table: Tensor) -> Tensor:
    """Rotate (B, T, H, D) by a (T, D/2, 2) table, in the half-split layout Hugging Face uses."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = table[None, :, None, :, 0], table[None, :, None, :, 1]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).type_as(x)


def kv_cache_shape(cfg: LlamaConfig, max_batch_size: int, max_seq_len: int) -> tuple[int, int, int, int]:
    """(B, KV heads, slots, D) of each layer's K and V cache: one slot more than max_seq_len, never
    written. A span of max_seq_len slots is then never the whole dimension, so the decode graph
    exported with a dynamic span has one code path; with slots == max_seq_len, export adds a
    contiguity branch for span == slots (and a runtime assert that refuses the longest window)."""
    return (max_batch_size, cfg.num_kv_heads, max_seq_len + 1, cfg.head_dim)


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

    def __init__(self, in_features: int, out_features: int, bias: bool, fusion: str = "none") -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.fusion = fusion

    def forward(self, x: Tensor, norm: RMSNorm | None = None, gate: bool = False, residual: Tensor | None = None) -> Tensor:
        inside = self.decode_fusion  # what the kernel does ("none" whenever decode_config is None)
        if norm is not None and inside not in NORMED:
            x, norm = norm(x), None
        if inside != "none":  # the kernel with (part of) the fusion; a fused Linear never has a bias
            in_gate, in_residual = "gate" in inside, "residual" in inside
            y = self._kernel(x, norm, gate and in_gate, residual if in_residual else None)
            gate, residual = gate and not in_gate, None if in_residual else residual
        elif self.decode_config is None:
            y = super().forward(x)
        else:
            y = self._kernel(x)
            y = y if self.bias is None else y + self.bias
        if gate:
            a, b = y.chunk(2, dim=-1)
            y = F.silu(a) * b
        return y if residual is None else residual + y

    def _kernel(self, x: Tensor, norm: RMSNorm | None = None, gate: bool = False, residual: Tensor | None = None) -> Tensor:
        """trtbuild's decode matmul with `decode_config`, doing whichever of norm, gate and residual it is given."""
        from trtbuild.kernels.decode_matmul import decode_matmul_op  # needs Triton: CUDA builds only

        c = self.decode_config
        gain = None if norm is None or norm.folded else norm.weight
        y = decode_matmul_op(x.reshape(-1, self.in_features), self.weight, gain,
                             None if residual is None else residual.reshape(-1, residual.shape[-1]),
                             0.0 if norm is None else norm.eps, gate, c.block_n, c.block_k, c.warps, c.stages,
                             c.split, norm is not None)
        return y.view(*x.shape[:-1], y.shape[-1])


class Attention(nn.Module):
    # Set by the backend only while it exports a decode graph that uses trtbuild's decode attention
    # kernel (options.decode_attention): "kernel" (rope, the cache writes and attention in one custom op),
    # "kernel-early" (the same op with its first reads before its PDL waits) or "kernel-unfused" (the
    # kernel attends; rope and the cache writes stay the model's ATen code).
    # Prefill, CPU builds and eager runs keep "aten": `_cached_attention`.
    decode_kernel: str = "aten"
    # Set by the backend only while it exports the prefill graph: "sdpa" or "cudnn" (causal_attention).
    prefill_kernel: str = "sdpa"

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.wqkv = Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.qkv_bias, fusion="norm")
        self.wo = Linear(q, cfg.hidden_size, bias=cfg.o_bias, fusion="residual")

    def forward(self, x: Tensor, rope: Tensor, table: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor,
                from_start: bool, span: Tensor | None, norm: RMSNorm, residual: Tensor) -> Tensor:
        """residual + attention(norm(x)): the norm and the add are the projections' (see Linear).
        `rope` is the whole (max_seq_len, D/2, 2) table, `table` its rows at `pos`."""
        c = self.cfg
        b, t, _ = x.shape
        q_size = c.num_heads * c.head_dim
        qkv = self.wqkv(x, norm=norm)
        if self.decode_kernel in ("kernel", "kernel-early"):
            from trtbuild.kernels import decode_attention  # needs Triton: CUDA builds only

            op = (decode_attention.decode_attention_rope_early_op if self.decode_kernel == "kernel-early"
                  else decode_attention.decode_attention_rope_op)
            y = op(qkv, rope, k_cache, v_cache, pos, c.num_heads)
            return self.wo(y.reshape(b, t, q_size), residual=residual)
        q_rows, k, v = rope_and_store(qkv, table, pos, k_cache, v_cache, c)
        q = q_rows.transpose(1, 2)
        # A prompt that starts at position 0 only attends to itself: a causal fused kernel over t
        # tokens, not a masked pass over the whole cache.
        if from_start:
            y = causal_attention(q, k, v, self.prefill_kernel)
        elif self.decode_kernel == "kernel-unfused":
            from trtbuild.kernels.decode_attention import decode_attention_op  # needs Triton: CUDA builds only

            # reads slots 0..pos of the whole cache buffer itself, so the window (span) is not needed
            return self.wo(decode_attention_op(q_rows, k_cache, v_cache, pos).reshape(b, t, q_size), residual=residual)
        else:
            y = _cached_attention(q, k_cache[:b], v_cache[:b], pos, span)
        return self.wo(y.transpose(1, 2).reshape(b, t, q_size), residual=residual)


def rope_and_store(qkv: Tensor, table: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor,
                   c: LlamaConfig) -> tuple[Tensor, Tensor, Tensor]:
    """Split the QKV projection's output (B, T, (H + 2 KV) D), rotate the query and the keys by `table`
    (rope's rows at `pos`) and write the keys and values into the caches at `pos`. Returns the query
    (B, T, H, D) and the new keys and values (B, KV, T, D). What the decode attention kernel does itself
    with options.decode_attention kernel."""
    b, t, _ = qkv.shape
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q_rows = apply_rope(q.view(b, t, c.num_heads, c.head_dim), table)
    k = apply_rope(k.view(b, t, c.num_kv_heads, c.head_dim), table).transpose(1, 2)
    v = v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
    # In-place writes into the static cache: export keeps these as buffer mutations, so the
    # prefill and decode graphs share one cache. Indexed on the whole buffer, never through a
    # slice of it: a write into `k_cache[:b]` with b < max_batch_size became a copy of the whole
    # slice (measured on the H200: 2 x 3.5 us per layer for batch-1 decode, 13% of the step).
    slot = (torch.arange(b, device=qkv.device)[:, None, None],
            torch.arange(c.num_kv_heads, device=qkv.device)[None, :, None], pos[None, None, :])
    k_cache.index_put_(slot, k)
    v_cache.index_put_(slot, v)
    return q_rows, k, v


def causal_attention(q: Tensor, k: Tensor, v: Tensor, kernel: str = "sdpa") -> Tensor:
    """Causal attention of a prompt over itself: q (B, H, T, D), k and v (B, KV, T, D) -> (B, H, T, D).
    "sdpa": SDPA's dispatch (FlashAttention-2 first on CUDA); "cudnn": cuDNN's fused attention, called
    directly (CUDA only; SDPA ranks it fourth); the build times both (backends/prefill_attention.py).
    Both take the KV heads as they are (GQA): repeating them would put the shape guards of the repeat's
    view arithmetic on the dynamic prompt length, which export cannot discharge on CUDA."""
    if kernel == "cudnn":
        # (query, key, value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask)
        return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, 0.0, True, False)[0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def _cached_attention(q: Tensor, keys: Tensor, values: Tensor, pos: Tensor, span: Tensor | None) -> Tensor:
    """Attention of q (B, H, T, D) at positions `pos` over the static cache (B, KV, S, D).

    `span` (W,) = arange(W) limits it to the first W slots, which must cover every position in
    `pos`: a decode graph exported with W dynamic reads only the filled part of the cache, not all
    max_seq_len slots (at batch 8 and 4096 slots, the whole cache of an 8B model is 4.3 GB a step,
    a quarter of its weights). None means the whole cache.

    The query heads that share a KV head are stacked into one matrix, so each step reads every cached
    K and V row once. Repeating K/V per query head instead (what SDPA's math path does for GQA) writes
    and reads H/KV copies of the cache every step: 4x the cache traffic on Llama-3 shapes, measured on
    the H200 as most of the gap between batch-8 decode and its floor.
    """
    b, h, t, d = q.shape
    if span is None:
        span = torch.arange(keys.shape[2], device=q.device)
    keys, values = keys[:, :, : span.shape[0]], values[:, :, : span.shape[0]]
    kv = keys.shape[1]
    rep = h // kv
    qg = q.reshape(b, kv, rep * t, d)  # query head i uses KV head i // rep (HF's repeat_kv order)
    scores = (qg @ keys.transpose(-1, -2)).float() * d**-0.5  # (B, KV, rep*T, W)
    # Causal mask over the static cache, from positions: slot j is visible to position p iff j <= p.
    visible = (span[None, :] <= pos[:, None]).repeat(rep, 1)  # (rep*T, W)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1).to(q.dtype)
    return (probs @ values).reshape(b, h, t, d)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w13 = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias, fusion="norm_gate")
        self.w2 = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, fusion="residual")

    def forward(self, x: Tensor, norm: RMSNorm, residual: Tensor) -> Tensor:
        """residual + w2(silu(gate) * up), [gate | up] = w13(norm(x))."""
        return self.w2(self.w13(x, norm=norm, gate=True), residual=residual)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, rope: Tensor, table: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor,
                from_start: bool, span: Tensor | None) -> Tensor:
        h = self.attention(x, rope, table, pos, k_cache, v_cache, from_start, span, self.attention_norm, x)
        return self.feed_forward(h, self.ffn_norm, h)


class Transformer(nn.Module):
    """forward(tokens (B, T) int64, input_pos (T,) int64) -> logits (B, V) of the last position.

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
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
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
        pairs += [(b.ffn_norm, b.feed_forward.w13) for b in blocks]
        if not self.cfg.tie_word_embeddings:
            pairs.append((self.norm, self.output))
        for norm, linear in pairs:
            linear.weight.copy_(linear.weight.float() * norm.weight.float()[None, :])
            norm.weight.fill_(1.0)
            norm.folded = True
            linear.fusion = FOLDED[linear.fusion]

    def forward(self, tokens: Tensor, input_pos: Tensor, all_logits: bool = False, from_start: bool = False,
                span: Tensor | None = None) -> Tensor:
        table = self.rope[input_pos]
        x = self.tok_embeddings(tokens)
        for i, layer in enumerate(self.layers):
            x = layer(x, self.rope, table, input_pos, getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}"), from_start,
                      span)
        if all_logits:
            return self.output(x, norm=self.norm)
        if from_start:  # a decode step's graph stays as it was: its compiled form is keyed by its program
            x = x.index_select(1, prompt_end(input_pos) - 1)
        return self.output(x[:, -1], norm=self.norm)


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
    of weight and cache tensors serves every package. A decode step takes a third input, the span of
    cache slots to attend over, whose length is the graph's one dynamic dimension. Both return the
    greedy next token (B, 1): the argmax is compiled into the graph (ATen's argmax over a 128K
    vocabulary took 35 us of every H200 decode step as a separate kernel), in two reductions
    (`greedy_token`).
    """

    def __init__(self, model: Transformer, from_start: bool) -> None:
        super().__init__()
        self.model = model
        self.from_start = from_start

    def forward(self, tokens: Tensor, input_pos: Tensor, span: Tensor | None = None) -> Tensor:
        return greedy_token(self.model(tokens, input_pos, from_start=self.from_start, span=span))


ARGMAX_CHUNK = 2048


def greedy_token(logits: Tensor) -> Tensor:
    """argmax(logits, -1, keepdim=True) in two reductions: the maximum of each chunk of 2048 logits, then
    of the chunks. Inductor compiles one argmax over a row as one program per row: at batch 1 a single
    program walked the 128K vocabulary, 29.5 us of a 1.1 ms 1B decode step on the H200 (RESULTS.md,
    eighth session). Chunked, the first reduction has a program per chunk. Same index as argmax, ties
    included: the first chunk holding the maximum, the first index inside it."""
    b, v = logits.shape
    chunks = -(-v // ARGMAX_CHUNK)
    padded = F.pad(logits, (0, chunks * ARGMAX_CHUNK - v), value=float("-inf")).view(b, chunks, ARGMAX_CHUNK)
    best, where = padded.max(-1)  # (B, chunks)
    chunk = best.argmax(-1, keepdim=True)
    return chunk * ARGMAX_CHUNK + where.gather(-1, chunk)
