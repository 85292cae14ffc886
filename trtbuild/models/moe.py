"""A mixture of experts in place of a decoder layer's MLP (Mixtral, Qwen3-MoE).

A router scores every expert for each token; the top k are chosen and their softmax weights, renormalized
to sum to one where the family does so (Mixtral always, Qwen3-MoE with `norm_topk_prob`), scale the outputs
of the chosen experts' gated MLPs. The experts' weights are stacked, one tensor per projection:
w13 (E, 2F, D) = [gate | up] of each expert, w2 (E, D, F); `checkpoint.convert_hf_state_dict` stacks a
checkpoint's per-expert tensors so.

Two exact ways to compute it, both free of data-dependent shapes (so both export):
- `gathered` (decode steps): the chosen experts' weights are gathered per token and only they are
  multiplied: a step reads k experts' weights, not E.
- `dense` (prompts): every expert runs on every token and the unchosen ones are weighted by zero. Correct,
  and E/k times the FLOPs of the chosen experts alone; grouping the tokens by expert (a grouped matmul) is
  what a prompt should do on the GPU and is not written yet (docs/models.md).
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
        y = self._gathered(h, weights, chosen) if gathered else self._dense(h, weights, chosen)
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

    def _dense(self, h: Tensor, weights: Tensor, chosen: Tensor) -> Tensor:
        every = torch.zeros(h.shape[0], self.gate.shape[0], dtype=h.dtype, device=h.device).scatter(1, chosen, weights)
        up = torch.einsum("nd,efd->nef", h, self.w13)  # (N, E, 2F)
        a, b = up.chunk(2, dim=-1)
        out = torch.einsum("nef,edf->ned", F.silu(a) * b, self.w2)
        return (out * every[..., None]).sum(1)
