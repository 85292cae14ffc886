"""The paged KV cache: each layer's keys and values in a pool of fixed-size blocks, read through block tables.

A pool is (num_blocks, KV heads, BLOCK, D); a sequence's position p lives in block table[p // BLOCK] at offset
p % BLOCK (trtbuild/serving/kv_blocks.py hands the tables out). One forward serves a prompt chunk from any start
position (after a cached prefix, or after the chunks before it) and a decode step of any rows: the new keys
and values are written through the table, then each query attends over its sequence's blocks, masked past its
own position. The pools are the graph's inputs, not its constants, so one compiled graph serves a pool of any
size (chosen at serve time from the memory left after the weights). On CUDA, for the models it serves, the
attention reads the pools through trtbuild's Triton kernel (kernels/paged_attention.py, `llama.paged_kernel`);
elsewhere it gathers each row's blocks and attends with ATen ops.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from trtbuild.models.llama import greedy_token, paged_attention

BLOCK = 16  # tokens a block (vLLM's default): small enough that a shared prefix rarely ends mid-block


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
        logits = self.model(tokens, input_pos, slots=blocks, pools=list(pools))
        return greedy_token(logits), logits


class MixedRows:
    """A mixed step's two kinds of rows, as the model sees them while it is traced: decode rows (Bd, 1) and
    prompt-chunk rows (Bc, Tc), each with its positions and block tables. Their tokens run as one sequence of
    Bd + Bc Tc rows through every matmul, so a step that decodes and prefills reads each weight once; only the
    attention is per kind (`attend`). Passed to `Transformer.forward` as its `slots`."""

    def __init__(self, dec_pos: Tensor, dec_blocks: Tensor, chunk_pos: Tensor, chunk_blocks: Tensor) -> None:
        self.dec_pos, self.dec_blocks, self.chunk_pos, self.chunk_blocks = dec_pos, dec_blocks, chunk_pos, chunk_blocks

    def attend(self, attn: Any, qkv: Tensor, table: Tensor, k_pool: Tensor, v_pool: Tensor) -> Tensor:
        """`paged_attention` of each kind's rows, over the QKV projection (1, S, ...) of the flat tokens and
        rope's rows `table` (1, S, ...) at their positions; (1, S, H D). The two kinds are different requests,
        so the order of their cache writes does not matter."""
        bd = self.dec_pos.shape[0]
        bc, tc = self.chunk_pos.shape
        # every size spelled out (no -1): export would otherwise guard on the sizes it infers
        x, rope, width = qkv[0], table[0], qkv.shape[-1]
        dec = paged_attention(attn, x[:bd].view(bd, 1, width), rope[:bd].view(bd, 1, *rope.shape[1:]), self.dec_pos,
                              self.dec_blocks, k_pool, v_pool)
        chunk = paged_attention(attn, x[bd:].view(bc, tc, width), rope[bd:].view(bc, tc, *rope.shape[1:]),
                                self.chunk_pos, self.chunk_blocks, k_pool, v_pool)
        out = dec.shape[-1]
        return torch.cat([dec.view(1, bd, out), chunk.view(1, bc * tc, out)], dim=1)

    def lasts(self, x: Tensor) -> Tensor:
        """Each row's last token of the flat hidden states (1, S, D), (Bd + Bc, 1, D): the decode rows' one token,
        each chunk row's last column (chunk rows are left-padded, so that is its own last token)."""
        bd = self.dec_pos.shape[0]
        bc, tc = self.chunk_pos.shape
        ends = torch.cat([torch.arange(bd, device=x.device), bd + torch.arange(1, bc + 1, device=x.device) * tc - 1])
        return x[0].index_select(0, ends)[:, None]


class MixedStep(nn.Module):
    """The exported mixed paged entry point: a decode step's rows and a step's prompt chunks in one forward.
    Inputs: decode tokens, positions (Bd, 1) and block tables (Bd, Nd); chunk tokens, positions (Bc, Tc) and
    tables (Bc, Nc); then every layer's K and V pools, written in place. Returns the greedy next token
    (Bd + Bc, 1) and the logits (Bd + Bc, V): the decode rows', then each chunk's last token's."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, input_pos: Tensor, blocks: Tensor, chunk_tokens: Tensor, chunk_pos: Tensor,
                chunk_blocks: Tensor, *pools: Tensor) -> tuple[Tensor, Tensor]:
        rows = MixedRows(input_pos, blocks, chunk_pos, chunk_blocks)
        flat = torch.cat([tokens.reshape(-1), chunk_tokens.reshape(-1)])[None]
        pos = torch.cat([input_pos.reshape(-1), chunk_pos.reshape(-1)])[None]
        logits = self.model(flat, pos, slots=rows, pools=list(pools))
        return greedy_token(logits), logits
