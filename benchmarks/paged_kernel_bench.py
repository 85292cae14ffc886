"""The paged attention kernel alone (trtbuild/kernels/paged_attention.py), eager launches on a GPU, against the
same file at another commit: prompt chunks and decode steps of the 1B's attention shapes.

    python benchmarks/paged_kernel_bench.py --against 5db31ec --out $OUT
    python benchmarks/paged_kernel_bench.py --against 5db31ec --before old_paged_attention.py --out $OUT

Each case is one layer's attention: q (B, T, 32 heads, 64) over pools of 8 KV heads, every row's blocks
scattered through the pool. Chunks: T tokens after S tokens already cached (B 1); decode: B rows of one token
at 512 tokens each. Times are medians of CUDA-event-timed launches (the kernels only; the graph around them
is paged_probe.py's). The two versions' outputs are compared too (bf16, max abs difference). Prints a table;
writes paged_kernel_bench.json under --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

CHUNKS = ((128, 0), (512, 0), (512, 1024), (2048, 0), (512, 3072))
DECODES = ((1, 512), (16, 512), (64, 512), (256, 512), (64, 2048))


def load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case(b: int, t: int, context: int, heads: int = 32, kv: int = 8, d: int = 64, block: int = 16) -> dict[str, Any]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(b * 7 + t)
    per = -(-(context + t) // block)
    total = b * per + 1
    perm = torch.randperm(total - 1, device="cuda", generator=g)
    table = perm[:b * per].view(b, per).contiguous()
    pools = [torch.randn(total, kv, block, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2)]
    q = torch.randn(b, t, heads, d, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = (torch.arange(context, context + t, device="cuda")[None, :].expand(b, t)).contiguous()
    return {"q": q, "k": pools[0], "v": pools[1], "pos": pos, "table": table}


def timed(fn: Any, iters: int) -> float:
    """Milliseconds of one eager call: three untimed, then timing.event_seconds' median of `iters`."""
    from trtbuild.timing import event_seconds

    for _ in range(3):
        fn()
    return event_seconds(fn, iters) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--against", default=None, help="a commit whose kernel file runs beside this one's")
    ap.add_argument("--before", type=Path, default=None,
                    help="that kernel file itself (where the checkout has no git history)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="paged-kernel-bench-out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from trtbuild.kernels import paged_attention

    versions = {"now": paged_attention}
    tmp = tempfile.TemporaryDirectory()
    if args.against or args.before:
        text = args.before.read_text() if args.before else subprocess.run(
            ["git", "show", f"{args.against}:trtbuild/kernels/paged_attention.py"], cwd=REPO, capture_output=True,
            text=True, check=True).stdout
        path = Path(tmp.name) / "paged_before.py"
        # its custom op under another namespace: one name registers once a process
        path.write_text(text.replace('"trtbuild::', '"trtbuild_before::'))
        versions = {"before": load(path, "paged_before"), **versions}
    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip() or "?"
    report: dict[str, Any] = {"commit": commit, "against": args.against, "device": torch.cuda.get_device_name(),
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "command": " ".join(sys.argv), "rows": []}
    cases = [("chunk", 1, t, s) for t, s in CHUNKS] + [("decode", b, 1, c) for b, c in DECODES]
    for kind, b, t, context in cases:
        x = case(b, t, context)
        row: dict[str, Any] = {"kind": kind, "rows": b, "tokens": t, "context": context}
        outs = {}
        for name, mod in versions.items():
            def call(mod: Any = mod) -> Any:
                return mod.paged_attention(x["q"], x["k"], x["v"], x["pos"], x["table"])

            row[f"{name}_ms"] = timed(call, args.iters)
            outs[name] = call().float()
        if len(outs) == 2:
            row["max_abs_diff"] = float((outs["now"] - outs["before"]).abs().max())
            row["speedup"] = row["before_ms"] / row["now_ms"]
        report["rows"].append(row)
        print(f"[paged_kernel_bench] {row}", flush=True)
        (out / "paged_kernel_bench.json").write_text(json.dumps(report, indent=1) + "\n")
    head = f"{'kind':<7} {'rows':>5} {'tokens':>6} {'context':>7} " + " ".join(f"{n + ' ms':>10}" for n in versions)
    print(head + (f" {'speed-up':>9} {'max diff':>9}" if len(versions) == 2 else ""))
    for r in report["rows"]:
        line = f"{r['kind']:<7} {r['rows']:>5} {r['tokens']:>6} {r['context']:>7} " + \
            " ".join(f"{r[n + '_ms']:>10.4f}" for n in versions)
        if "speedup" in r:
            line += f" {r['speedup']:>9.2f} {r['max_abs_diff']:>9.4f}"
        print(line)


if __name__ == "__main__":
    main()
