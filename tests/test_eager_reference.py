"""The eager reference the GPU tests judge bf16 engines by: ties that bf16 rounding makes are not failures,
a token far from eager's best is."""

from __future__ import annotations

from pathlib import Path

import torch

from trtbuild.models.source import resolve
from trtbuild.recipe import load_recipe

from .conftest import TINY_CONFIG, tiny_recipe_doc, write_recipe
from .engine_helpers import eager_disagreements, eager_greedy

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]]  # the GPU decode-kernel test's


def test_a_bf16_tie_taken_the_other_way_is_eager_and_a_far_token_is_not(tmp_path: Path) -> None:
    """A tiny bf16 model (seed 31) whose second prompt's third token is a bf16 tie: bf16 eager takes 114, fp32
    takes 122, as a kernel that sums in fp32 and rounds once may (the H200's fused kernels did so on another
    seed's model, 2026-12-04). The other side of the tie passes; a token whose logit is 0.29 below the best
    does not."""
    recipe = load_recipe(write_recipe(tmp_path, tiny_recipe_doc(precision="bf16", model={
        "source": "synthetic", "seed": 31, "config": dict(TINY_CONFIG)})))
    folder = resolve(recipe.model, tmp_path / "store").materialize()
    want = [row[:4] for row in eager_greedy(folder, PROMPTS, 4, 48, dtype=torch.bfloat16)]
    assert want[1] == [39, 14, 114, 14]  # the seed's model in bf16
    assert eager_greedy(folder, PROMPTS, 4, 48)[1] == [39, 14, 122, 15]  # fp32 takes the other side of the tie

    assert eager_disagreements(folder, PROMPTS, want, 48, dtype=torch.bfloat16) == []
    assert eager_disagreements(folder, PROMPTS, [want[0], [39, 14, 122, 15]], 48, dtype=torch.bfloat16) == []
    wrong = eager_disagreements(folder, PROMPTS, [want[0], [39, 14, 1, 14]], 48, dtype=torch.bfloat16)
    assert wrong and wrong[0].startswith("row 1 token 2: 1"), wrong
