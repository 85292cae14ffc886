"""Ragged decode on CUDA: the slot API's steps replayed through the decode graphs (captured per bucket and
cache window, some of them while other rows hold sequences) give each sequence the eager model's tokens; the
bf16 engine runs trtbuild's decode attention kernel with per-row positions and cache rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from trtbuild.builder import build
from trtbuild.recipe import load_recipe
from trtbuild.runner import open_session
from trtbuild.backends.sampling import Sampling

from .conftest import tiny_recipe_doc, write_recipe
from .engine_helpers import eager_disagreements, eager_greedy

pytestmark = pytest.mark.gpu

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
           [9, 9], [5, 4, 3, 2, 1, 0, 11, 12, 13, 14, 15]]
SEQ = 64  # cache windows 16, 32, 64: the rows cross them at different steps


def _ragged(engine: Any, prompts: list[list[int]], steps: int, sampling: Sampling = Sampling()) -> list[list[int]]:
    """Rows admitted at different steps into the highest free rows first, decoded together each at its own
    position, released when done: what a server's scheduler does, in the least convenient row order."""
    free = list(range(engine.max_batch_size))
    waiting = list(enumerate(prompts))
    out: dict[int, list[int]] = {}
    rows: dict[int, tuple[int, int]] = {}  # slot -> (prompt index, position of the next token fed)
    while waiting or rows:
        if waiting and free:
            i, p = waiting.pop(0)
            slot = free.pop()
            out[i] = [engine.prefill(slot, p, sampling)]
            rows[slot] = (i, len(p))
        slots = sorted(rows, reverse=True)
        if not slots:
            continue
        nxt = engine.decode(slots, [out[rows[s][0]][-1] for s in slots], [rows[s][1] for s in slots],
                            [sampling] * len(slots))
        for s, t in zip(slots, nxt):
            i, pos = rows[s]
            out[i].append(t)
            rows[s] = (i, pos + 1)
            if len(out[i]) == steps:
                del rows[s]
                engine.release(s)
                free.append(s)
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_ragged_slot_decode_on_cuda_gives_each_row_the_eager_models_tokens(tmp_path: Path, precision: str) -> None:
    doc = tiny_recipe_doc(precision=precision, shapes={"max_batch_size": 4, "max_input_len": 24, "max_seq_len": SEQ,
                                                      "batch_buckets": [1, 2, 4]})
    if precision == "bf16":  # head_dim 16: the decode attention kernel serves it
        doc["model"]["config"] = dict(doc["model"]["config"], hidden_size=64, num_attention_heads=4)
    recipe = load_recipe(write_recipe(tmp_path, doc))
    outcome = build(recipe, tmp_path / "store")
    attention = outcome.entry.manifest["tactics"]["decode_attention"]["used"]
    assert attention == ("kernel" if precision == "bf16" else "aten")
    with open_session(recipe, tmp_path / "store", build=False) as session:
        engine = session.engine
        got = _ragged(engine, PROMPTS, 30)
        assert any(d.graphs for d in engine._decoders.values())  # the steps were replayed graphs
        seeded = Sampling(temperature=0.8, top_p=0.9, seed=4)
        assert _ragged(engine, PROMPTS, 12, seeded) == _ragged(engine, PROMPTS, 12, seeded)
        assert _ragged(engine, PROMPTS, 12, Sampling(temperature=1.0, top_k=1, seed=4)) == [g[:12] for g in got]
        timed = session.greedy([PROMPTS[0]], 12)  # the timed greedy path, after the slot API used the cache
    folder = outcome.model.materialize()
    for p, tokens in zip(PROMPTS, got, strict=True):
        if precision == "fp32":
            assert tokens == eager_greedy(folder, [p], 30, SEQ, device="cuda")[0]
            assert timed[0] == got[0][:12]  # (bf16: another bucket's matmuls may round a near tie the other way)
        else:  # the kernel sums in fp32 and rounds once: a bf16 tie may go either way (eager_disagreements)
            assert eager_disagreements(folder, [p], [tokens], SEQ, dtype=torch.bfloat16, device="cuda") == []
