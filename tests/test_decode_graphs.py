"""DecodeGraphs' static inputs: what a compiled decode graph is handed on every step."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trtbuild.backends.torch.decode_graphs import DecodeGraphs


class _Package:
    """A decode package's call: greedy ids (B, 1) and logits (B, V); records the inputs it was handed."""

    def __init__(self) -> None:
        self.seen: list[tuple[Any, ...]] = []

    def __call__(self, tok: Any, pos: Any, slots: Any, span: Any) -> tuple[Any, Any]:
        self.seen.append((tok.clone(), pos.clone(), slots.clone(), span.shape[0]))
        return tok + 1, torch.zeros(tok.shape[0], 4)


@pytest.mark.parametrize("batch", [1, 2, 3, 8, 9])
def test_inputs_start_on_16_byte_boundaries_and_a_step_reads_its_rows(batch: int) -> None:
    """Compiled graphs assume 16-byte aligned inputs and copy any other into an aligned tensor on every
    call: at batch 1 the positions, a row of 8 bytes after the tokens, were off by 8 bytes."""
    package = _Package()
    graphs = DecodeGraphs(package, batch, 64, "cpu")
    for t in (graphs.tok, graphs.pos, graphs.slots):
        assert t.data_ptr() % 16 == 0 and t.is_contiguous()
    rows = torch.tensor([[5 + i for i in range(batch)], [10 + i for i in range(batch)], list(range(batch))])
    greedy, _ = graphs.run(rows, 10 + batch - 1)
    tok, pos, slots, _ = package.seen[-1]
    assert tok.view(-1).tolist() == rows[0].tolist() and pos.view(-1).tolist() == rows[1].tolist()
    assert slots.tolist() == rows[2].tolist() and greedy.view(-1).tolist() == (rows[0] + 1).tolist()
