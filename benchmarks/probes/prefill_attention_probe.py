"""Prefill attention: SDPA's dispatch (FlashAttention-2 on CUDA) against cuDNN's fused attention, per prompt
length, on each recipe's head shape: the measurement a build's `options.prefill_attention: auto` makes
(`trtbuild/backends/prefill_attention.measure`, batch 1, causal, the model's GQA heads), one length at a
time, with each kernel's rate in TFLOP/s. A probe for reading the choice, not a benchmark of the engine
(bench.py's engine@sdpa-prefill / engine@cudnn-prefill are that). Needs CUDA.

    python benchmarks/probes/prefill_attention_probe.py recipes/llama-3.1-8b.yaml recipes/llama-3.2-1b.yaml --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from trtbuild.backends.torch.prefill_attention import measure  # noqa: E402
from trtbuild.models.llama import LlamaConfig  # noqa: E402
from trtbuild.recipe import load_recipe  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--lengths", default="128,512,1024,2048,4096")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    print(f"{'recipe':<16} {'T':>5} {'sdpa us':>9} {'cudnn us':>9} {'sdpa TF/s':>9} {'cudnn TF/s':>10} "
          f"{'cudnn 1st ms':>12} {'max|diff|':>9}")
    for path in args.recipes:
        recipe = load_recipe(path)
        assert recipe.model.config is not None, "the probe takes recipes with an inline (synthetic) config"
        cfg = LlamaConfig.from_hf(recipe.model.config)
        for t in (int(x) for x in args.lengths.split(",")):
            r = measure(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, [t])
            flop = 2 * 2 * cfg.num_heads * t * t * cfg.head_dim / 2  # QK^T and PV, half under the causal mask
            row = {"recipe": recipe.name, "length": t, **r,
                   "sdpa_tflops": flop / r["sdpa_us"] / 1e6,
                   "cudnn_tflops": flop / r["cudnn_us"] / 1e6 if r["cudnn_us"] else None}
            rows.append(row)
            first = r["cudnn_first_call_ms"][0] if r["cudnn_first_call_ms"] else float("nan")
            print(f"{recipe.name:<16} {t:>5} {r['sdpa_us']:>9.1f} {r['cudnn_us']:>9.1f} {row['sdpa_tflops']:>9.0f} "
                  f"{row['cudnn_tflops'] or 0:>10.0f} {first:>12.2f} {r['max_abs_diff']:>9.3g}"
                  + (f"  cuDNN: {r['cudnn_error']}" if "cudnn_error" in r else ""), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "prefill_attention_probe.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
