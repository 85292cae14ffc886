"""The paged KV cache: each layer's keys and values in a pool of fixed-size blocks, read through block tables.

A pool is (num_blocks, KV heads, BLOCK, D); a sequence's position p lives in block table[p // BLOCK] at offset
p % BLOCK (trtbuild/kv_blocks.py hands the tables out). One forward serves a prompt chunk from any start
position (after a cached prefix, or after the chunks before it) and a decode step of any rows: the new keys
and values are written through the table, then each query attends over its sequence's blocks, masked past its
own position. The pools are the graph's inputs, not its constants, so one compiled graph serves a pool of any
size (chosen at serve time from the memory left after the weights).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

BLOCK = 16  # tokens a block (vLLM's default): small enough that a shared prefix rarely ends mid-block


def paged_attention(attn: Any, qkv: Tensor, table: Tensor, pos: Tensor, blocks: Tensor, k_pool: Tensor,
                    v_pool: Tensor) -> Tensor:
    """`attn` (llama.Attention) over the QKV projection (B, T, (H + 2 KV) D) of tokens at positions `pos`
    (B, T), rope's rows `table` at those positions; `blocks` (B, N) each sequence's block table, N blocks
    covering every position in `pos`. Writes the keys and values into the pools; returns (B, T, H D)."""
    from trtbuild.models.llama import _cached_attention, apply_rope

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


def pool_shape(cfg: Any, num_blocks: int) -> tuple[int, int, int, int]:
    """One layer's K (or V) pool."""
    return (num_blocks, cfg.num_kv_heads, BLOCK, cfg.head_dim)


class PagedStep(nn.Module):
    """The exported paged entry point over a shared Transformer: tokens (B, T), their positions (B, T), each
    sequence's block table (B, N), then the K and V pools of every layer (2 L inputs, written in place).
    Returns the greedy next token (B, 1) and the logits (B, V) of each row's last position."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, input_pos: Tensor, blocks: Tensor, *pools: Tensor) -> tuple[Tensor, Tensor]:
        from trtbuild.models.llama import greedy_token

        logits = self.model(tokens, input_pos, slots=blocks, pools=list(pools))
        return greedy_token(logits), logits
