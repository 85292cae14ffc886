"""Each family beyond Llama built by trtbuild on the CPU (AOTInductor, fp32) from a folder transformers
saved, and run through the compiled packages: greedy tokens identical to transformers', across the sliding
windows and, for the mixtures of experts, with the decode steps' gathered experts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from trtbuild.builder import build
from trtbuild.recipe import load_recipe
from trtbuild.runner import Session

from .test_families import DECODE_STEPS, PROMPT_LEN, hf_model, hf_reference, prompts

pytestmark = pytest.mark.slow

# one build per family: the case of tests/test_families.py that covers most of what the family needs
BUILT = ["qwen3", "phi3-longrope-window", "gemma3", "gemma2", "mixtral", "qwen3-moe"]


@pytest.fixture(params=BUILT, scope="module")
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp(request.param)
    hf = hf_model(request.param)
    hf.save_pretrained(root / "model", safe_serialization=True)
    doc = {"name": request.param, "model": {"source": "./model"}, "backend": "torch", "precision": "fp32",
           # two buckets: on the CPU they share one decode graph with a dynamic batch, which each family's
           # export must allow (test_buckets_sharing_the_decode_graph_give_each_row_its_tokens_at_batch_1)
           "shapes": {"max_batch_size": 2, "max_input_len": 16, "max_seq_len": 32, "batch_buckets": [1, 2]},
           "tactics": {"level": "none"}, "run": {"batch_size": 2, "input_len": PROMPT_LEN, "output_len": DECODE_STEPS}}
    (root / "recipe.yaml").write_text(yaml.safe_dump(doc))
    recipe = load_recipe(root / "recipe.yaml")
    outcome = build(recipe, root / "store")
    return {"hf": hf, "recipe": recipe, "store": root / "store", "outcome": outcome}


def test_compiled_engine_generates_transformers_tokens(engine: dict[str, Any]) -> None:
    tokens = prompts()
    _, want = hf_reference(engine["hf"], tokens)
    # the build's own entry (re-resolving the recipe would key it again, for no purpose here)
    with Session(engine["recipe"], engine["outcome"], engine["store"], allow_build=False) as session:
        got = session.greedy(tokens.tolist(), DECODE_STEPS)
    assert got == want


def test_buckets_sharing_the_decode_graph_give_each_row_its_tokens_at_batch_1(engine: dict[str, Any]) -> None:
    """Each prompt alone runs the batch-1 bucket, the same compiled decode graph as the batch of 2."""
    tokens = prompts()
    _, want = hf_reference(engine["hf"], tokens)
    graphs = json.loads((engine["outcome"].entry.path / "engine.json").read_text())["graphs"]
    assert graphs["decode_b1"]["digest"] == graphs["decode_b2"]["digest"] == graphs["prefill"]["digest"]
    with Session(engine["recipe"], engine["outcome"], engine["store"], allow_build=False) as session:
        got = [session.greedy([row], DECODE_STEPS)[0] for row in tokens.tolist()]
    assert got == want


def test_the_manifest_records_the_paths_the_family_takes(engine: dict[str, Any]) -> None:
    manifest = engine["outcome"].entry.manifest
    paths = manifest["tactics"]["model_paths"]
    cfg = json.loads((engine["recipe"].model.path / "config.json").read_text())
    assert paths["family"] == cfg["model_type"]
    if cfg["model_type"] in ("mixtral", "qwen3_moe"):
        assert "gathered" in paths["experts"] and "dense" in paths["experts"]
    if cfg.get("sliding_window"):
        assert "masked" in paths["attention"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", BUILT)
def test_cuda_bf16_engine_of_each_family_matches_eager_within_bf16_rounding(tmp_path: Path, name: str) -> None:
    """bf16 on CUDA with the build's tactic selection (trtbuild's decode matmul kernel where it times faster,
    the family's fallbacks elsewhere): each token the eager model's best, given the engine's tokens before
    it, within bf16 rounding (engine_helpers.eager_disagreements), past the sliding windows."""
    import torch

    from .engine_helpers import eager_disagreements

    hf_model(name).save_pretrained(tmp_path / "model", safe_serialization=True)
    doc = {"name": name, "model": {"source": "./model"}, "backend": "torch", "precision": "bf16",
           "shapes": {"max_batch_size": 2, "max_input_len": 16, "max_seq_len": 32, "batch_buckets": [1, 2]},
           "tactics": {"level": "default"}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(doc))
    recipe = load_recipe(tmp_path / "recipe.yaml")
    outcome = build(recipe, tmp_path / "store")
    assert outcome.entry.manifest["key_material"]["device"]["kind"] == "cuda"
    tokens = prompts().tolist()
    with Session(recipe, outcome, tmp_path / "store", allow_build=False) as session:
        got = session.greedy(tokens, DECODE_STEPS)
        one = session.greedy(tokens[:1], DECODE_STEPS)  # the batch-1 decode graph
    folder = tmp_path / "model"
    assert eager_disagreements(folder, tokens, got, 32, dtype=torch.bfloat16, device="cuda") == []
    assert eager_disagreements(folder, tokens[:1], one, 32, dtype=torch.bfloat16, device="cuda") == []
