"""Eager references for engine tests: the same model code, run without export or compilation."""

from __future__ import annotations

from pathlib import Path

import torch

from trtbuild.models.checkpoint import convert_hf_state_dict, load_weights, read_config
from trtbuild.models.llama import Transformer


def eager_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int, max_seq_len: int,
                 dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[list[int]]:
    """Greedy tokens from the eager Transformer: prefill, then one decode step at a time."""
    _, cfg = read_config(folder)
    model = Transformer(cfg, len(prompts), max_seq_len, dtype)
    # assign: the parameters take the checkpoint's dtype, as in the engine (a copy into the module's fp32
    # parameters left a bf16 model computing in fp32 against its bf16 cache: found on the H200)
    model.load_state_dict(convert_hf_state_dict(load_weights(folder, cfg, dtype), cfg), strict=False, assign=True)
    model = model.to(device)
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
