"""The eager reference the GPU tests judge bf16 engines by: ties that bf16 rounding makes are not failures,
a token far from eager's best is."""

from __future__ import annotations

from pathlib import Path

import torch

from trtbuild.models.source import resolve
from trtbuild.recipe import load_recipe

from .conftest import tiny_recipe_doc, write_recipe
from .engine_helpers import eager_disagreements, eager_greedy

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8, 1, 8]]  # the GPU decode-kernel test's


def test_a_bf16_tie_taken_the_other_way_is_eager_and_a_far_token_is_not(tmp_path: Path) -> None:
    """The tiny bf16 model of tests/test_gpu.py: its third token is a bf16 tie (14 and 31). The H200's
    fused kernels (H200, 2026-12-04) produced [26, 18, 31, 43], the fp32 model's tokens;
    that passes, and a token whose logit is 0.17 below the best does not."""
    recipe = load_recipe(write_recipe(tmp_path, tiny_recipe_doc(precision="bf16")))
    folder = resolve(recipe.model, tmp_path / "store").materialize()
    want = [row[:4] for row in eager_greedy(folder, PROMPTS, 4, 48, dtype=torch.bfloat16)]
    assert want[0] == [26, 18, 14, 15]  # the seed's model, as on the H200 (its eager tokens were these)
    assert eager_greedy(folder, PROMPTS, 4, 48)[0] == [26, 18, 31, 43]  # fp32 takes the other side of the tie

    assert eager_disagreements(folder, PROMPTS, want, 48, dtype=torch.bfloat16) == []
    assert eager_disagreements(folder, PROMPTS, [[26, 18, 31, 43], want[1]], 48, dtype=torch.bfloat16) == []
    wrong = eager_disagreements(folder, PROMPTS, [[26, 18, 78, 43], want[1]], 48, dtype=torch.bfloat16)
    assert wrong and wrong[0].startswith("row 0 token 2: 78"), wrong
