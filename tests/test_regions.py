"""Regional compilation (models/regions.py): which layers share a compiled program, and a CPU engine built by
regions that gives the eager model's tokens through the row cache and the paged cache alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from trtbuild.builder import build
from trtbuild.models.llama import LlamaConfig, Transformer
from trtbuild.models.regions import Region, constant_name, kind, plan
from trtbuild.recipe import load_recipe
from trtbuild.runner import open_session

from .conftest import TINY_CONFIG, tiny_recipe_doc, write_recipe
from .engine_helpers import eager_greedy


def model_of(**config: Any) -> Transformer:
    cfg = LlamaConfig.from_hf(dict(TINY_CONFIG, **config))
    with torch.device("meta"):
        return Transformer(cfg, 2, 48, torch.float32)


def test_layers_of_one_kind_share_a_program_and_the_last_has_its_own() -> None:
    assert plan(model_of(num_hidden_layers=6)) == [[0, 1, 2, 3, 4], [5]]
    assert plan(model_of(num_hidden_layers=4)) == [[0, 1, 2], [3]]


def test_too_few_layers_a_program_compile_the_whole_graph() -> None:
    """Two or three layers would cost as many programs as layers (each a C++ wrapper of its own): no regions."""
    assert plan(model_of(num_hidden_layers=2)) == []
    assert plan(model_of(num_hidden_layers=3)) == []


def test_sliding_and_global_layers_are_kinds_of_their_own() -> None:
    """Gemma-style: every third layer global, the rest a sliding window with the local rope pair."""
    model = model_of(model_type="gemma3_text", num_hidden_layers=8, sliding_window=16, sliding_window_pattern=3,
                     head_dim=8, query_pre_attn_scalar=8)
    windows = [block.attention.window for block in model.layers]
    regions = plan(model)
    assert sorted(i for r in regions for i in r) == list(range(8)) and regions[-1] == [7]
    for region in regions[:-1]:  # one window a program
        assert len({windows[i] for i in region}) == 1
    assert len(regions) == 3, (windows, regions)
    assert kind(model.layers[0]) != kind(model.layers[2])


def test_region_constants_map_onto_the_whole_models_names() -> None:
    assert constant_name("block.attention.wqkv.weight", 3) == "model.layers.3.attention.wqkv.weight"
    assert constant_name("k_cache", 3) == "model.k_cache_3"
    assert constant_name("output.weight", 5) == "model.output.weight"
    assert constant_name("rope", 0) == "model.rope"


def test_regions_chained_by_hand_are_the_whole_model() -> None:
    """Each layer's region in turn, on the embeddings, fills the same caches and ends in the same logits."""
    torch.manual_seed(0)
    cfg = LlamaConfig.from_hf(dict(TINY_CONFIG, num_hidden_layers=4))
    model = Transformer(cfg, 2, 48, torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        tokens, pos, rows = torch.randint(0, 128, (2, 7)), torch.arange(7), torch.tensor([1, 0])
        whole = model(tokens, pos, from_start=True, slots=rows)
        caches = [getattr(model, f"k_cache_{i}").clone() for i in range(4)]
        for i in range(4):
            getattr(model, f"k_cache_{i}").zero_()
        x = model.tok_embeddings(tokens)
        for i in range(4):
            out = Region(model, i, from_start=True)(x, pos, rows)
            x = out[0]
    assert torch.allclose(out[1], whole, atol=1e-5)
    assert all(torch.equal(getattr(model, f"k_cache_{i}"), caches[i]) for i in range(4))


def test_by_default_the_paged_step_stays_whole() -> None:
    """Served by regions, the paged step cost an H100 10-13% of its tokens a second (export.regional)."""
    from trtbuild.backends.torch.export import regional

    assert regional("prefill", "regional") and regional("decode_b8", "regional")
    assert not regional("paged", "regional") and regional("paged", "regional-all")
    assert not regional("prefill", "whole")


@pytest.mark.slow
def test_an_engine_built_by_regions_gives_the_eager_tokens_through_rows_and_pages(tmp_path: Path) -> None:
    """Four layers, every graph by regions (options.compile regional-all): one program for layers 0-2 and one
    for the last, for the step program the prefill and the decode buckets share and for the paged graph: four
    programs, dealt out to the build and its forks. The row
    cache's greedy tokens and the paged cache's (prompts prefilled together through scattered block tables,
    then decode steps) are the eager model's."""
    import os

    from trtbuild.backends.sampling import GREEDY
    from trtbuild.backends.torch.mixed_graphs import PagedMixedGraphs
    from trtbuild.backends.torch.paged_graphs import PagedChunkGraphs
    from trtbuild.models.paged import BLOCK

    config = dict(TINY_CONFIG, num_hidden_layers=4)
    doc = tiny_recipe_doc(options={"kv_cache": "paged", "compile": "regional-all"},
                          model={"source": "synthetic", "seed": 0, "config": config})
    recipe = load_recipe(write_recipe(tmp_path, doc))
    outcome = build(recipe, tmp_path / "store")
    spec = json.loads((outcome.entry.path / "engine.json").read_text())
    for name in ("prefill", "decode_b2", "paged"):
        regions = spec["graphs"][name]["regions"]
        assert [r["layers"] for r in regions] == [[0, 1, 2], [3]]
        assert all(r["so"] in outcome.entry.manifest["files"] for r in regions)
    assert "so" not in spec["graphs"]["prefill"]
    if (os.cpu_count() or 1) >= 2:  # three programs compiled in forks beside the build's own
        forked = [r for name in ("prefill", "paged") for r in spec["graphs"][name]["regions"] if "worker" in r]
        assert len(forked) == 3 and all(r["worker"]["ok"] for r in forked), forked
    folder = outcome.model.materialize()
    prompts = [[4, 8, 15, 16, 23, 42], [1, 2, 3, 5, 8, 13]]
    tables = [[5, 1, 7], [2, 6, 0]]
    with open_session(recipe, tmp_path / "store", build=False) as session:
        assert session.greedy(prompts, 10) == eager_greedy(folder, prompts, 10, 48)
        engine = session.engine
        engine.open_pool(blocks=10)
        streams = [[t] for t in engine.prefill_paged([0, 1], tables, prompts, [0, 0], [GREEDY] * 2, [True] * 2)]
        for i in range(9):
            positions = [len(p) + i for p in prompts]
            got = engine.decode_paged([0, 1], [t[:-(-(p + 1) // BLOCK)] for t, p in zip(tables, positions)],
                                      [s[-1] for s in streams], positions, [GREEDY] * 2)
            for s, tok in zip(streams, got):
                s.append(tok)
        # the same steps launched, each read back only after the next is launched, the next's tokens fed on
        # the device from the step before's output; a third prompt prefilled in the mixed step of the third
        third = [9, 9, 4, 1, 7, 3]

        def launched_steps(keys: list[int]) -> tuple[list[list[int]], int | None]:
            a, b, c = keys
            launched = [[t] for t in engine.prefill_paged([a, b], tables, prompts, [0, 0], [GREEDY] * 2, [True] * 2)]
            before, first = None, None
            for i in range(9):
                positions = [len(p) + i for p in prompts]
                rows = ([a, b], [t[:-(-(p + 1) // BLOCK)] for t, p in zip(tables, positions)],
                        [s[-1] for s in launched] if before is None else [0, 0], positions, [GREEDY] * 2)
                chunks = ([c], [[3, 4]], [third], [0], [GREEDY], [True]) if i == 2 else None
                step = engine.launch_paged(rows, chunks, [] if before is None else [(0, 0), (1, 1)])
                if before is not None:
                    decoded, firsts = before.result()
                    first = firsts[0] if firsts else first
                    for s, tok in zip(launched, decoded):
                        s.append(tok)
                before = step
            for s, tok in zip(launched, before.result()[0]):
                s.append(tok)
            for key in keys:
                engine.release(key)
            return launched, first

        launched, first = launched_steps([2, 3, 4])
        # again with the chunk through a chunk graph's bucket beside the decode rows' call, as `serve
        # --captured-chunks` runs it (captured on CUDA; on the CPU the bucket's padded inputs go to the package)
        engine.captured_chunks = True
        paged = engine.paged
        paged.chunks = PagedChunkGraphs(paged.package, paged.pools, "cpu", max(2, paged.max_blocks), paged.scratch,
                                        engine.max_seq_len, engine.max_input_len, BLOCK)
        assert engine.chunk_buckets and engine.can_mix
        bucketed, first_bucketed = launched_steps([5, 6, 7])
        # the two prompts went through the (2, 16) bucket, the 6-token chunk beside the rows through (1, 16)
        assert sorted(paged.chunks.inputs) == [(1, 16), (2, 16)]
        # and with the launched mixed step through a mixed graph's bucket (`captured_mixed`, serve's default)
        engine.captured_chunks = False
        paged.mixed_graphs = PagedMixedGraphs(paged.mixed_package, paged.pools, "cpu", max(2, paged.max_blocks),
                                              paged.scratch, engine.max_seq_len, 10, engine.max_input_len, BLOCK,
                                              token_flops=1.0)
        mixed, first_mixed = launched_steps([8, 9, 10])
        assert sorted(paged.mixed_graphs.inputs) == [(16, 1, 16)]  # prompts of 16 tokens at most
    assert streams == launched == bucketed == mixed == eager_greedy(folder, prompts, 10, 48)
    assert first == first_bucketed == first_mixed == eager_greedy(folder, [third], 1, 48)[0][0]
