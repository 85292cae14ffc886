"""What quantizing the LM head alone costs in perplexity: SmolLM2-135M-Instruct (a tied head: the embedding table)
in fp32, then with the head rounded to nearest in int8 (one scale an output channel) and in int4 (a scale and
zero a group of 64), dequantized, the embedding table kept fp32; scored by `trtbuild eval`'s eager perplexity
(windows of 512 a half-window apart) on the four texts of benchmarks/texts/. No engine is built.

    python3 benchmarks/probes/head_quality.py --out DIR

Writes head_quality.json under --out and prints a table. Needs the SmolLM2 folder (benchmarks/smollm2.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

WINDOW = 512
CASES = (("fp32", None), ("head int8", "int8"), ("head int4", "int4"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()
    import smollm2
    import torch

    from trtbuild.backends.torch.export import place_model
    from trtbuild.measure.evaluate import eager_scorer, perplexity, text_ids
    from trtbuild.models import quantize
    from trtbuild.models.checkpoint import convert_hf_state_dict, load_weights, read_config

    model_dir = smollm2.folder()
    _, cfg = read_config(model_dir)
    ids = {t.name: text_ids(t, model_dir / "tokenizer.json", cfg.vocab_size)[0] for t in smollm2.TEXTS}
    dense = convert_hf_state_dict(load_weights(model_dir, cfg, torch.float32), cfg)
    shapes = SimpleNamespace(max_batch_size=4, max_input_len=WINDOW, max_seq_len=WINDOW)
    rows: dict[str, dict[str, float]] = {}
    for name, fmt in CASES:
        t = time.perf_counter()
        state = dict(dense)  # "output.weight" is the embedding table's tensor (tied); it is replaced, not changed
        if fmt is not None:
            stored = quantize.quantize(fmt, state["output.weight"].clone())
            state["output.weight"] = quantize.dequantize(fmt, stored["qweight"], stored["scale"], stored.get("zero"),
                                                         torch.float32)
        score = eager_scorer(place_model(cfg, shapes, torch.float32, "cpu", state))
        rows[name] = {text: perplexity(score, i, WINDOW)["perplexity"] for text, i in ids.items()}
        print(f"{name}: {time.perf_counter() - t:.1f} s", flush=True)
    base = rows["fp32"]
    report = {"model": "SmolLM2-135M-Instruct", "window": WINDOW,
              "perplexity": {n: {x: {"value": p, "vs_fp32_pct": 100 * (p / base[x] - 1)} for x, p in r.items()}
                             for n, r in rows.items()}}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "head_quality.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'':10s}" + "".join(f"{text:>22s}" for text in ids))
    for name, r in rows.items():
        print(f"{name:10s}" + "".join(f"{r[x]:13.3f} {100 * (r[x] / base[x] - 1):+7.2f}%" for x in ids))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
