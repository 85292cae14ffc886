"""Where an AOTInductor compile's C++ seconds go on a GPU host: the same small CUDA program compiled in fresh
processes, (1) with a cold Inductor cache, (2) again with another shape in the same cache (whatever the first
compile left on disk, its precompiled header included, is reused), (3) in a new cold cache with
`aot_inductor.precompile_headers` off. Each with the build's Inductor options for a decode graph
(backends/torch/inductor.inductor_configs). Prints each compile's wall seconds and Inductor's timers.

    python3 benchmarks/probes/aoti_cxx_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(width: int, precompile: bool, out: Path) -> None:
    """One compile, in this process (a fresh one, so that Inductor reads the cache folder it is given)."""
    sys.path.insert(0, str(ROOT))
    import torch
    from torch._dynamo.utils import compilation_time_metrics as metrics

    from trtbuild.backends.torch.inductor import inductor_configs

    class Small(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(width, width, bias=False)
            self.b = torch.nn.Linear(width, width, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.nn.functional.silu(self.a(x)) * x) + x

    model = Small().cuda().to(torch.bfloat16)
    x = torch.randn(8, width, device="cuda", dtype=torch.bfloat16)
    program = torch.export.export(model, (x,))
    configs = inductor_configs("default", "cuda", "decode_b8") | {"aot_inductor.precompile_headers": precompile}
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        torch._inductor.aoti_compile_and_package(program, package_path=f"{tmp}/p.pt2", inductor_configs=configs)
    wall = time.perf_counter() - t
    timers = {k: round(sum(v), 3) for k, v in sorted(metrics.items(), key=lambda kv: -sum(kv[1])) if sum(v) >= 0.05}
    out.write_text(json.dumps({"width": width, "precompile_headers": precompile, "wall_s": round(wall, 3),
                               "timers": timers}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(int(args.child[0]), args.child[1] == "1", Path(args.child[2]))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        for label, cache, width, pch in (("cold cache", a, 512, True), ("same cache, another shape", a, 768, True),
                                         ("cold cache, precompile_headers off", b, 512, False)):
            result = Path(tempfile.mktemp(suffix=".json"))
            env = os.environ | {"TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton"}
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--child", str(width), "1" if pch else "0", str(result)],
                                  env=env, capture_output=True, text=True)
            row = json.loads(result.read_text()) if result.is_file() else {"error": proc.stderr[-800:]}
            row |= {"case": label, "process_s": round(time.perf_counter() - t, 2)}
            results.append(row)
            print(json.dumps(row)[:1500], flush=True)
    (args.out / "aoti_cxx_probe.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
