"""Regional compilation: a decoder layer compiled once and run for each layer of its kind.

The unrolled model repeats one layer's operations for every layer, and Inductor and the C++ compiler pay for
each repeat: a 30-layer model's two graphs cost ~154 s of Inductor on 2 CPU cores, ~2.2 s a layer a graph
(benchmarks/RESULTS.md). Compiled by regions instead, a graph is a few programs: one for the layers of each
kind (a family's sliding and global layers, dense and mixture-of-experts layers), and one for the last layer
with the final norm, LM head and greedy token behind it. The embedding in front is one gather, run by the
runtime (`llama.embed`). The runtime calls a region for every layer it serves with that layer's weights and
KV cache as the region's constants (`backends/torch/runtime.Regional`), inside the same CUDA graphs as a
whole graph's step.

Fewer programs, not only smaller ones: each compiled program also pays a fixed cost, its C++ wrapper's
compile (~7-9 s on 2 CPU cores for a single layer, 2026-12-06), so the embedding gets no program of its own.

A region's constants are named as its modules are here ("block.attention.wqkv.weight", "k_cache", "rope",
"output.weight"); `constant_name` maps them to the whole model's ("model.layers.3.attention.wqkv.weight",
"model.k_cache_3"), so one set of weight and cache tensors serves whole and regional graphs alike.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from torch import Tensor, nn

from trtbuild.models.llama import greedy_token, head, positions


class Region(nn.Module):
    """Layer `layer` of `model` as a graph of its own, for a prompt (`from_start`), a decode step, or a paged
    step (`paged`: the layer's K and V pools are inputs, the block tables are `slots`).

    forward(x, input_pos, slots, *rest): `x` the hidden states (B, T, H), the embeddings or the layer before's;
    `rest` a decode step's span, or a paged step's two pools. Returns (hidden states,), or for the last layer
    (greedy token (B, 1), logits (B, V)) as `llama.Step` does."""

    def __init__(self, model: Any, layer: int, from_start: bool, paged: bool = False) -> None:
        super().__init__()
        self.last, self.from_start, self.paged = layer == len(model.layers) - 1, from_start, paged
        self.block = model.layers[layer]
        self.register_buffer("rope", model.rope, persistent=False)
        if not paged:
            self.register_buffer("k_cache", getattr(model, f"k_cache_{layer}"), persistent=False)
            self.register_buffer("v_cache", getattr(model, f"v_cache_{layer}"), persistent=False)
        self.cap = model.cfg.final_softcap
        if self.last:
            self.norm, self.output = model.norm, model.output

    def forward(self, x: Tensor, input_pos: Tensor, slots: Tensor, *rest: Tensor) -> tuple[Tensor, ...]:
        pos = positions(input_pos)
        if self.paged:
            k_cache, v_cache, span = rest[0], rest[1], None
        else:
            k_cache, v_cache, span = self.k_cache, self.v_cache, (rest[0] if rest else None)
        x = self.block(x, self.rope, self.rope[pos], pos, slots, k_cache, v_cache, self.from_start, span)
        if not self.last:
            return (x,)
        logits = head(self.norm, self.output, self.cap, x, input_pos, self.from_start)
        return greedy_token(logits), logits


def plan(model: Any) -> list[list[int]]:
    """The layers each region program runs, its first layer the one it is exported from: the layers before the
    last grouped by kind (`kind`), then the last. Empty where compiling regions would not save most of the
    work (fewer than two layers a program): the whole graph is then one program, as it always was."""
    n = len(model.layers)
    groups: dict[str, list[int]] = {}
    for i, block in enumerate(list(model.layers)[:-1]):
        groups.setdefault(kind(block), []).append(i)
    regions = [*groups.values(), [n - 1]]
    return regions if 2 * len(regions) <= n else []


def kind(block: nn.Module) -> str:
    """What makes two layers compile to the same program: each submodule's class and plain settings (a
    sliding window, which rope pair, a mixture of experts, a quantized format, a routed kernel) and each
    tensor's name, shape and dtype. Their values are not in it: a region's weights are its constants."""
    parts: list[Any] = []
    for name, module in block.named_modules():
        settings = {k: v for k, v in sorted(vars(module).items())
                    if not k.startswith("_") and k != "training" and _plain(v)}
        parts.append([name, type(module).__qualname__, settings])
    for name, t in [*block.named_parameters(), *block.named_buffers()]:
        parts.append([name, list(t.shape), str(t.dtype)])
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _plain(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def constant_name(fqn: str, layer: int) -> str:
    """The whole model's constant name for a region's constant `fqn` when the region runs layer `layer`."""
    if fqn.startswith("block."):
        return f"model.layers.{layer}.{fqn.removeprefix('block.')}"
    if fqn in ("k_cache", "v_cache"):
        return f"model.{fqn}_{layer}"
    return f"model.{fqn}"
