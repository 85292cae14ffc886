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

from torch import Tensor, nn

from trtbuild.models.llama import greedy_token, paged_attention  # noqa: F401 - the attention is the model's own

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
