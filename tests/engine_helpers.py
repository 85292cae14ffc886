"""Eager references for engine tests: the same model code, run without export or compilation."""

from __future__ import annotations

from pathlib import Path

import torch

from trtbuild.models.checkpoint import convert_hf_state_dict, load_weights, read_config
from trtbuild.models.llama import Transformer


def _eager_model(folder: Path, batch: int, max_seq_len: int, dtype: torch.dtype, device: str) -> Transformer:
    """The model folder's Transformer, eager, its cache for `batch` sequences of `max_seq_len`."""
    _, cfg = read_config(folder)
    model = Transformer(cfg, batch, max_seq_len, dtype)
    # assign: the parameters take the checkpoint's dtype, as in the engine (a copy into the module's fp32
    # parameters left a bf16 model computing in fp32 against its bf16 cache: found on the H200)
    model.load_state_dict(convert_hf_state_dict(load_weights(folder, cfg, dtype), cfg), strict=False, assign=True)
    return model.to(device)


def eager_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[list[int]]:
    """Greedy tokens from the eager Transformer: prefill, then one decode step at a time."""
    model = _eager_model(folder, len(prompts), max_seq_len, dtype, device)
    tokens = torch.tensor(prompts, device=device)
    t = tokens.shape[1]
    out = []
    with torch.no_grad():
        nxt = model(tokens, torch.arange(t, device=device)).argmax(-1, keepdim=True)
        out.append(nxt)
        for i in range(max_new_tokens - 1):
            nxt = model(nxt, torch.tensor([t + i], device=device)).argmax(-1, keepdim=True)
            out.append(nxt)
    return torch.cat(out, dim=1).tolist()


def eager_disagreements(folder: Path, prompts: list[list[int]], tokens: list[list[int]], max_seq_len: int,
                        dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[str]:
    """Where an engine's greedy `tokens` are not the eager model's choice, fed the engine's own tokens
    (teacher forcing, so one early difference does not make every later token differ).

    A token counts as the eager model's if its logit is within two bf16 steps of the best one: a kernel
    that sums in fp32 and rounds once may take the other side of a tie that bf16 rounding made (on a tiny
    test model's third token, 2026-12-04, two tokens were both 2.3906 in bf16, 2.3809 against 2.4002 in fp32,
    and the H200's fused kernels chose the one bf16 eager did not). A wrong kernel lands far outside that."""
    model = _eager_model(folder, len(prompts), max_seq_len, dtype, device)
    t = len(prompts[0])
    chosen = torch.tensor(tokens, device=device)
    found = []
    with torch.no_grad():
        logits = model(torch.tensor(prompts, device=device), torch.arange(t, device=device))
        for i in range(chosen.shape[1]):
            step = logits.reshape(len(prompts), -1, logits.shape[-1])[:, -1].float()
            best = step.max(-1).values
            got = step.gather(-1, chosen[:, i:i + 1]).squeeze(-1)
            for row in (got < best - best.abs() * 2 ** -6).nonzero().flatten().tolist():
                found.append(f"row {row} token {i}: {tokens[row][i]} (logit {got[row]:.4f}) where eager's best is "
                             f"{int(step[row].argmax())} ({best[row]:.4f})")
            logits = model(chosen[:, i:i + 1], torch.tensor([t + i], device=device))
    return found
