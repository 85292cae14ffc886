"""A real model's greedy text from a trtbuild bf16 engine against transformers' bf16 greedy on the same device.

    python benchmarks/greedy_match.py --model HF_FOLDER --engines /tmp/e --out result.json

SmolLM2-135M-Instruct (benchmarks/smollm2.py makes its folder) in bf16: each prompt's token ids, the same
for both, generated greedily for up to --new-tokens tokens by the engine (`Session.generate`, temperature 0)
and by transformers' `generate(do_sample=False)`. Equal means: identical, position for position, until the
first position where transformers' two best logits are a bf16 tie (`is_tie`); there two implementations that
round differently may pick either token, and their texts part. The matched prefix is reported either way.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PROMPTS = ("The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,",
           "The three primary colors are")
# A tie: the gap between the two best logits is at most TIE_ULPS spacings of bf16 at the best logit's size.
# One spacing is 2^(e - 7) for |logit| in [2^e, 2^(e+1)) (8 significant bits); two bf16 implementations that
# sum in different orders through 30 layers differ by a few spacings at the logits, so a gap that small does
# not decide which token is right.
TIE_ULPS = 4


def bf16_spacing(x: float) -> float:
    """The distance between neighbouring bf16 values at |x|."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0 ** -126))) - 7)


def is_tie(top1: float, top2: float) -> bool:
    return top1 - top2 <= TIE_ULPS * bf16_spacing(top1)


def match(engine: Sequence[int], reference: Sequence[int], top2: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """Compare two greedy continuations: `top2[i]` is the reference's two best logits at position i.

    Returns {"equal", "matched", "compared", "stop"}: equal is True when they agree up to the shorter one's end,
    or up to the first position where they differ and the reference's best two logits tie there; `matched`
    is the length of the identical prefix."""
    n = min(len(engine), len(reference))
    for i in range(n):
        if engine[i] != reference[i]:
            tie = is_tie(*top2[i])
            return {"equal": tie, "matched": i, "compared": n,
                    "stop": f"position {i}: {'a bf16 tie' if tie else 'NOT a tie'} "
                            f"(transformers' best two logits {top2[i][0]:.4f} / {top2[i][1]:.4f}, "
                            f"engine {engine[i]}, transformers {reference[i]})"}
    return {"equal": True, "matched": n, "compared": n, "stop": "identical"}


def reference(model_dir: Path, prompts: list[list[int]], new_tokens: int, device: str) -> list[dict[str, Any]]:
    """transformers' bf16 greedy continuation of each prompt, with its two best logits at every position."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(device).eval()
    out = []
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        with torch.no_grad():
            g = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                               do_sample=False, output_logits=True, return_dict_in_generate=True)
        tokens = g.sequences[0, len(ids):].tolist()
        best = [tuple(float(v) for v in step[0].float().topk(2).values) for step in g.logits]
        out.append({"tokens": tokens, "top2": best})
    del model
    return out


def run(model_dir: Path, engines: str | None, new_tokens: int, work: Path) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import smollm2
    import torch

    from trtbuild.builder import build
    from trtbuild.recipe import load_recipe
    from trtbuild.runner import open_session

    device = "cuda" if torch.cuda.is_available() else "cpu"
    path = smollm2.recipe(model_dir, "bf16", work)
    recipe = load_recipe(str(path))
    t = time.perf_counter()
    outcome = build(recipe, engines)
    result: dict[str, Any] = {"recipe": str(path), "device": device, "new_tokens": new_tokens, "tie_ulps": TIE_ULPS,
                              "build_s": outcome.build_s, "cache_hit": outcome.cache_hit,
                              "build_wall_s": time.perf_counter() - t}
    with open_session(recipe, engines, build=False) as session:
        prompts = [session.encode(p) for p in PROMPTS]
        completions = session.generate(prompts, max_tokens=new_tokens, temperature=0.0)
        mine = [list(c.token_ids) for c in completions]
    refs = reference(model_dir, prompts, new_tokens, device)
    rows = []
    for text, ids, e, r in zip(PROMPTS, prompts, mine, refs, strict=True):
        rows.append({"prompt": text, "prompt_ids": len(ids), "engine": e, "transformers": r["tokens"],
                     **match(e, r["tokens"], r["top2"])})
    result["prompts"] = rows
    result["equal"] = sum(r["equal"] for r in rows)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="the Hugging Face folder (smollm2.py folder / unpack)")
    ap.add_argument("--engines", default=None)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--work", type=Path, default=Path("/tmp/greedy-match"), help="where the recipe is written")
    ap.add_argument("--out", type=Path, required=True, help="the result's JSON file")
    args = ap.parse_args()
    result = run(args.model, args.engines, args.new_tokens, args.work)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in result["prompts"]:
        print(f"{'equal' if r['equal'] else 'DIFFERENT'}: {r['prompt']!r}: {r['matched']} of {r['compared']} tokens "
              f"identical; {r['stop']}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # trtbuild, run from a checkout
    import trtbuild  # noqa: F401  - before torch: one libstdc++ for the compiled graphs

    main()
