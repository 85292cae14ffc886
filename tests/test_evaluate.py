"""`trtbuild eval`'s perplexity: windows that score every token after the first once, its arithmetic against
transformers' loss, and the engine's compiled scoring graph against the eager model on a tiny engine."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trtbuild.errors import InputError
from trtbuild.measure.evaluate import eager_scorer, evaluate, perplexity, windows
from trtbuild.recipe import load_recipe

from .conftest import TINY_CONFIG, make_hf_folder, tiny_recipe_doc, write_recipe


@pytest.mark.parametrize("n, window, stride", [(900, 512, 256), (161, 512, 256), (100, 32, 16), (97, 32, 31),
                                               (2, 8, 4), (33, 32, 16), (1000, 512, 511)])
def test_windows_score_every_token_after_the_first_exactly_once(n: int, window: int, stride: int) -> None:
    spans = windows(n, window, stride)
    scored = [p for _, end, first in spans for p in range(first, end)]
    assert scored == list(range(1, n))  # each once, in order: the last partial window included
    assert all(end - begin <= window and begin < first for begin, end, first in spans)
    assert spans[-1][1] == n
    if n <= window:  # a text shorter than a window: one window, scored whole
        assert spans == [(0, n, 1)]
    else:  # past the first window every scored token has at least window - stride tokens of context
        assert all(first - begin >= window - stride for begin, _, first in spans[1:])


def test_a_stride_that_leaves_no_new_token_is_refused() -> None:
    with pytest.raises(InputError, match="--stride"):
        windows(100, 32, 32)


def _tiny_model(tmp_path: Path, rows: int, window: int) -> tuple[torch.nn.Module, Path]:
    from trtbuild.backends.torch.export import place_model
    from trtbuild.models.checkpoint import convert_hf_state_dict, load_weights, read_config

    folder = make_hf_folder(tmp_path / "m")
    _, cfg = read_config(folder)
    state = convert_hf_state_dict(load_weights(folder, cfg, torch.float32), cfg)
    from types import SimpleNamespace

    shapes = SimpleNamespace(max_batch_size=rows, max_input_len=window, max_seq_len=window)
    return place_model(cfg, shapes, torch.float32, "cpu", state), folder


@pytest.mark.parametrize("n", [100, 20])
def test_perplexity_is_that_of_transformers_over_the_same_windows(tmp_path: Path, n: int) -> None:
    """Strided windows (and a text shorter than one) against Hugging Face's logits on the same spans."""
    transformers = pytest.importorskip("transformers")
    model, folder = _tiny_model(tmp_path, 2, 32)
    ids = [(i * 7 + i // 3) % TINY_CONFIG["vocab_size"] for i in range(n)]
    got = perplexity(eager_scorer(model), ids, 32, stride=12, batch=2)
    assert got["tokens_scored"] == n - 1 and got["windows"] == len(windows(n, 32, 12))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    nll = 0.0
    with torch.no_grad():
        for begin, end, first in windows(n, 32, 12):
            logits = hf(torch.tensor([ids[begin:end]])).logits[0]
            nll += F.cross_entropy(logits[first - begin - 1:end - begin - 1], torch.tensor(ids[first:end]),
                                   reduction="sum").item()
    assert math.isclose(got["perplexity"], math.exp(nll / (n - 1)), rel_tol=1e-4)


@pytest.mark.slow
def test_the_engines_scoring_graph_agrees_with_the_eager_model_and_scores_the_whole_text(tmp_path: Path) -> None:
    """`evaluate` through a tiny int8_wo engine's compiled scoring graph and through the eager cross-check:
    within 0.5% of each other, every token after the first scored (a text longer than a window, its last
    window partial), the scoring graph kept in the compiled-graph cache, and the engine's key unchanged."""
    from trtbuild.builder import build

    shapes = {"max_batch_size": 2, "max_input_len": 16, "max_seq_len": 48, "batch_buckets": [2]}
    recipe = load_recipe(write_recipe(tmp_path, tiny_recipe_doc(name="tiny-int8", precision="int8_wo", shapes=shapes)))
    fp32 = load_recipe(write_recipe(tmp_path, tiny_recipe_doc(name="tiny-fp32", shapes=shapes), "fp32.yaml"))
    key = build(recipe, tmp_path / "engines").key
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 3)  # 135 bytes: 135 tokens
    lines: list[str] = []
    engine = evaluate(recipe, text, tmp_path / "engines", against=fp32, progress=lines.append)
    eager = evaluate(recipe, text, tmp_path / "engines", eager=True)
    assert engine["tokens"] == 135 and engine["tokens_scored"] == eager["tokens_scored"] == 134
    assert engine["windows"] == len(windows(135, 48, 24)) and engine["stride"] == 24
    assert engine["scored_by"].startswith("the engine's compiled scoring graph") and eager["scored_by"].startswith("eager")
    assert abs(engine["perplexity"] / eager["perplexity"] - 1) < 0.005, (engine["perplexity"], eager["perplexity"])
    assert engine["scoring_graph"]["reused"] is False
    # the progress goes on through the comparison with the other engine
    assert any("windows scored" in line for line in lines)
    assert [line for line in lines if "tiny-fp32" in line][-1].startswith("greedy tokens")
    assert lines[-1].startswith("teacher-forced")
    again = evaluate(recipe, text, tmp_path / "engines")
    assert again["scoring_graph"]["reused"] is True and again["perplexity"] == engine["perplexity"]
    assert build(recipe, tmp_path / "engines").key == key  # the scoring graph is no part of the entry or key
