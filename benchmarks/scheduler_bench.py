"""The serving scheduler's host work per decode step, by running rows, with an engine that does nothing.

    python benchmarks/scheduler_bench.py --out /tmp/sched          # rows 1, 16, 64, 256
    python benchmarks/scheduler_bench.py --rows 256 --steps 500 --out /tmp/sched

A GPU's decode step for hundreds of rows takes a few milliseconds; the host's bookkeeping between two steps
(admission, block tables, metrics, delivering each row's token) is time the GPU waits for, as the step reads
the tokens back before the next one starts. This measures that bookkeeping alone: the paged scheduler
(trtbuild/serving/scheduler.py) over a block pool with the prefix cache on, the server's Prometheus metrics
as its observer, and the paged graph's bucket buffer filled as PagedDecodeGraphs fills it (without a
device copy). Rows decode prompts of 700 tokens, so block tables are ~45 entries a row. Prints a table and
writes scheduler_bench.json and, where matplotlib imports, scheduler_bench.png under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from trtbuild.backends.torch.paged_graphs import PagedDecodeGraphs, bucket_for, buckets  # noqa: E402
from trtbuild.serving.kv_blocks import BlockPool  # noqa: E402
from trtbuild.serving.scheduler import Request, Scheduler  # noqa: E402

BLOCK, PROMPT, MAX_SEQ = 16, 700, 4096


class NoWorkEngine:
    """The paged slot API, computing nothing: a decode step fills the bucket's host buffer and returns."""

    max_batch_size, max_input_len, max_seq_len, vocab_size = 256, 2048, MAX_SEQ, 1000

    def __init__(self, rows: int) -> None:
        self.graphs = PagedDecodeGraphs(None, [], "cpu", width=MAX_SEQ // BLOCK, scratch=1 << 20, max_rows=rows)

    def prefill_paged(self, keys: list[int], blocks: list[list[int]], tokens: list[list[int]], starts: list[int],
                      sampling: list[Any], lasts: list[bool]) -> list[int | None]:
        return [1 if last else None for last in lasts]

    def decode_paged(self, keys: list[int], blocks: list[list[int]], tokens: list[int], positions: list[int],
                     sampling: list[Any]) -> list[int]:
        rows = [b[:(p + BLOCK) // BLOCK] for b, p in zip(blocks, positions)]
        self.graphs.host_rows(bucket_for(len(keys), self.graphs.sizes), rows, tokens, positions)
        return [2] * len(keys)

    def release(self, key: int) -> None:
        pass


def measure(rows: int, steps: int) -> dict[str, float]:
    from trtbuild.serving.metrics import Metrics

    sched = Scheduler(NoWorkEngine(rows), max_queue=10_000, buckets=buckets(rows), observer=Metrics("bench"),
                      pool=BlockPool(rows * (MAX_SEQ // BLOCK), BLOCK), chunk_tokens=rows * PROMPT)
    for i in range(rows):
        sched.submit(Request(prompt=[(i + j) % 1000 for j in range(PROMPT)], max_tokens=MAX_SEQ - PROMPT - 1,
                             on_event=lambda ev: None))
    sched.step()  # admission and every prompt
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        sched.step()
        times.append(time.perf_counter() - t)
    times.sort()
    return {"rows": rows, "steps": steps, "p50_ms": times[len(times) // 2] * 1e3,
            "p90_ms": times[int(len(times) * 0.9)] * 1e3, "per_row_us": times[len(times) // 2] * 1e6 / rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,64,256", help="comma list of running rows")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default="scheduler-bench-out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip() or "?"
    report = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": commit,
              "host": f"{platform.processor() or platform.machine()}, {platform.python_version()}",
              "command": " ".join(sys.argv), "levels": [measure(int(n), args.steps) for n in args.rows.split(",")]}
    (out / "scheduler_bench.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"scheduler_bench: {report['date']}, commit {commit}, {report['host']}")
    print(f"{'rows':>5} {'step p50 ms':>12} {'p90 ms':>8} {'per row us':>11}")
    for lv in report["levels"]:
        print(f"{lv['rows']:>5} {lv['p50_ms']:12.3f} {lv['p90_ms']:8.3f} {lv['per_row_us']:11.1f}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable here: no plot (the JSON has every number)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([lv["rows"] for lv in report["levels"]], [lv["p50_ms"] for lv in report["levels"]], "o-")
    ax.set(xscale="log", xlabel="running rows", ylabel="host ms a step (p50)",
           title=f"scheduler host work a decode step, {commit}")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "scheduler_bench.png", dpi=110)


if __name__ == "__main__":
    main()
