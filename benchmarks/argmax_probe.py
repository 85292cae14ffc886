"""The greedy token of a decode step: one argmax over the vocabulary against `llama.greedy_token` (the
maximum of each 2048-logit chunk, then of the chunks), both compiled by Inductor as the engine's graphs
are, timed inside a CUDA graph (no launch overhead, as in the engine). The 1B profile of the eighth
session showed the single argmax at 29.5 us of a 1.1 ms step. A probe for one change, not a benchmark
of the engine (bench.py is that). Needs CUDA.

    python benchmarks/argmax_probe.py --vocab 128256 --batches 1,8 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from trtbuild.timing import graph_seconds  # noqa: E402
from trtbuild.models.llama import greedy_token  # noqa: E402


def argmax(logits: Tensor) -> Tensor:
    return logits.argmax(-1, keepdim=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default="bench-out")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    print(f"{'batch':>5} {'argmax us':>10} {'chunked us':>11} {'same index':>10}", flush=True)
    for b in (int(x) for x in args.batches.split(",")):
        logits = torch.randn(b, args.vocab, device="cuda", dtype=torch.bfloat16)
        row: dict[str, Any] = {"batch": b, "vocab": args.vocab}
        for name, fn in (("argmax", argmax), ("chunked", greedy_token)):
            compiled = torch.compile(fn, dynamic=False)
            # 20 per graph replay, so the replay's own few microseconds are spread thin
            def calls(c: Any = compiled, x: torch.Tensor = logits) -> None:
                for _ in range(20):
                    c(x)

            row[f"{name}_us"] = graph_seconds(calls, args.reps) / 20 * 1e6
            row[f"{name}_index"] = compiled(logits).flatten().tolist()
        row["same"] = row["argmax_index"] == row["chunked_index"]
        rows.append(row)
        print(f"{b:>5} {row['argmax_us']:>10.2f} {row['chunked_us']:>11.2f} {str(row['same']):>10}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "argmax_probe.json").write_text(json.dumps({"device": torch.cuda.get_device_name(0),
                                                       "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
