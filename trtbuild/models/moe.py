"""A mixture of experts in place of a decoder layer's MLP (Mixtral, Qwen3-MoE).

A router scores every expert for each token; the top k are chosen and their softmax weights, renormalized
to sum to one where the family does so (Mixtral always, Qwen3-MoE with `norm_topk_prob`), scale the outputs
of the chosen experts' gated MLPs. The experts' weights are stacked, one tensor per projection:
w13 (E, 2F, D) = [gate | up] of each expert, w2 (E, D, F); `checkpoint.convert_hf_state_dict` stacks a
checkpoint's per-expert tensors so.

Two exact ways to compute it, both free of data-dependent shapes (so both export):
- `gathered` (decode steps): the chosen experts' weights are gathered per token and only they are
  multiplied: a step reads k experts' weights, not E.
- `dense` (prompts, the default): every expert runs on every token and the unchosen ones are weighted by
  zero. Correct in every dtype, and E/k times the FLOPs of the chosen experts alone.
- `grouped` (prompts, options.moe_prefill grouped): the tokens grouped by expert, one grouped matmul per
  projection (16-bit only: torch._grouped_mm).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class MoE(nn.Module):
    # "kernel": decode steps through trtbuild's Triton gather (kernels/moe_gather.py: the chosen experts'
    # weights read in place, CUDA only). No build sets it yet: tested against "aten" (tests/test_moe_kernel.py).
    decode_kernel: str = "aten"
    # "grouped": a prompt's tokens sorted by expert and multiplied in one grouped matmul per projection
    # (torch._grouped_mm: 16-bit weights, CUDA of compute capability 9.0 or the CPU); "dense": every expert on
    # every token. Set by the backend (options.moe_prefill).
    prefill_kernel: str = "dense"

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k = cfg.experts_per_token
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Parameter(torch.empty(e, d))  # the router
        self.w13 = nn.Parameter(torch.empty(e, 2 * f, d))
        self.w2 = nn.Parameter(torch.empty(e, d, f))

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(N, D) -> the chosen experts' weights (N, k) in x's dtype and their indices (N, k), as transformers
        computes them: softmax in fp32 over every expert, top k, renormalized where the family does so."""
        probs = F.linear(x, self.gate).float().softmax(-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x: Tensor, norm: Callable[[Tensor], Tensor], residual: Tensor | None,
                gathered: bool = False) -> Tensor:
        """residual + moe(norm(x)) for x (B, T, D); `gathered` for a decode step (see the module's docstring)."""
        shape = x.shape
        h = norm(x).reshape(-1, shape[-1])
        weights, chosen = self.route(h)
        if gathered:
            y = self._gathered(h, weights, chosen)
        elif self.prefill_kernel == "grouped":
            y = self._grouped(h, weights, chosen)
        else:
            y = self._dense(h, weights, chosen)
        y = y.reshape(shape)
        return y if residual is None else residual + y

    def _gathered(self, h: Tensor, weights: Tensor, chosen: Tensor) -> Tensor:
        if self.decode_kernel == "kernel":
            from trtbuild.kernels.moe_gather import moe_gathered_op  # needs Triton

            return moe_gathered_op(h, self.w13, self.w2, chosen, weights)
        up = torch.einsum("nd,nkfd->nkf", h, self.w13[chosen])  # (N, k, 2F): each token's k experts
        a, b = up.chunk(2, dim=-1)
        out = torch.einsum("nkf,nkdf->nkd", F.silu(a) * b, self.w2[chosen])
        return (out * weights[..., None]).sum(1)

    def _grouped(self, h: Tensor, weights: Tensor, chosen: Tensor) -> Tensor:
        """Each (token, chosen expert) pair as a row, the rows sorted by expert, one grouped matmul per
        projection over the experts' segments (`offs`, the segments' ends): each expert's weights read
        once, each token multiplied by its k experts only. Every shape is static (N * k rows), so it exports."""
        n, k = chosen.shape
        experts = self.gate.shape[0]
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        counts = torch.zeros(experts, dtype=torch.int32, device=h.device).scatter_add(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = counts.cumsum(0, dtype=torch.int32)
        up = torch._grouped_mm(h.index_select(0, order // k), self.w13.transpose(-2, -1), offs=offs)
        a, b = up.chunk(2, dim=-1)
        down = torch._grouped_mm(F.silu(a) * b, self.w2.transpose(-2, -1), offs=offs)
        out = torch.empty_like(down).index_copy(0, order, down)  # back in (token, j) order
        return (out.view(n, k, -1) * weights[..., None]).sum(1)

    def _dense(self, h: Tensor, weights: Tensor, chosen: Tensor) -> Tensor:
        every = torch.zeros(h.shape[0], self.gate.shape[0], dtype=h.dtype, device=h.device).scatter(1, chosen, weights)
        up = torch.einsum("nd,efd->nef", h, self.w13)  # (N, E, 2F)
        a, b = up.chunk(2, dim=-1)
        out = torch.einsum("nef,edf->ned", F.silu(a) * b, self.w2)
        return (out * every[..., None]).sum(1)
