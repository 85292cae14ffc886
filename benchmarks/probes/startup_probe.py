"""Where a restart's start-up goes, before the engine loads anything: what bounds a warm restart.

On the H200 host a warm 8B restart takes 5.3 s, of which `import torch` alone takes 2.6-4.4 s (the
device call's "start-up parts" line) against 0.65 s to read the weights into GPU memory, so the restart
target (2x the read) is out of reach of any process that imports torch as it is. This probe splits that
import, each part in new processes (median of `--repeats`):

  - `python -c pass`: the interpreter alone;
  - the shared libraries alone: libtorch's CUDA and CPU libraries loaded with ctypes, no Python module of
    torch imported (what any process linked to libtorch pays, a native runner too);
  - `import torch`, then `import torch` with one CUDA tensor (the context);
  - `import torch` with a fresh `PYTHONPYCACHEPREFIX`, twice: the first run compiles and writes every
    module's bytecode there, the second reads it. Against the plain import it says whether torch's own
    bytecode is missing or stale on this image (then each process compiles ~1100 modules again);
  - the census of torch's .py files with and without current bytecode beside them;
  - `python -X importtime -c "import torch"`: the modules that take longest themselves;
  - with `--native`, a C++ program linked to libtorch (built here with the compiler on PATH) that makes
    one tensor on the device: the floor of a restart that never starts Python's torch.

Writes startup-probe.json under --out and prints a table last.

    python3 benchmarks/probes/startup_probe.py --native --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NATIVE_SOURCE = r"""
#include <ATen/ATen.h>
#include <chrono>
#include <cstdio>
int main(int argc, char** argv) {
  auto t0 = std::chrono::steady_clock::now();
  bool cuda = argc > 1 && std::string(argv[1]) == "cuda";
  at::Tensor t = at::ones({1}, at::TensorOptions().device(cuda ? at::kCUDA : at::kCPU));
  float v = t.sum().item<float>();  // waits for the device
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("%.4f %.1f\n", s, v);
  return 0;
}
"""


def wall(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    """Seconds from start to exit of a new process, and what it printed."""
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, check=True)
    return time.perf_counter() - t, done.stdout.strip()


def median_wall(cmd: list[str], repeats: int, env: dict[str, str] | None = None) -> float:
    return statistics.median(wall(cmd, env)[0] for _ in range(repeats))


def torch_dirs() -> tuple[Path, Path]:
    """torch's package folder and its lib folder, found without importing torch."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise SystemExit("torch is not importable here")
    pkg = Path(spec.origin).parent
    return pkg, pkg / "lib"


def libraries(lib: Path) -> list[Path]:
    """The libraries `import torch` loads first (CUDA's where the wheel has them), in dependency order."""
    names = ["libc10.so", "libc10_cuda.so", "libtorch_cpu.so", "libtorch_cuda.so", "libtorch.so"]
    return [lib / n for n in names if (lib / n).exists()]


def bytecode_census(pkg: Path) -> dict[str, Any]:
    """How many of torch's modules have current bytecode beside them (what `import` reads instead of
    compiling), and whether this process could write it."""
    import importlib.util

    sources = list(pkg.rglob("*.py"))
    cached = sum(1 for s in sources if Path(importlib.util.cache_from_source(str(s))).exists())
    return {"py_files": len(sources), "with_bytecode": cached, "package_writable": os.access(pkg, os.W_OK),
            "python": sys.version.split()[0], "cache_tag": sys.implementation.cache_tag,
            "PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE", "")}


def slowest_imports(importtime_stderr: str, top: int = 12) -> dict[str, Any]:
    """The modules with the largest self time in `python -X importtime` output (µs)."""
    rows = []
    for line in importtime_stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|\s*(\S+)", line)
        if m:
            rows.append((int(m[1]), int(m[2]), m[3]))
    rows.sort(reverse=True)
    return {"modules": len(rows), "self_s_total": sum(r[0] for r in rows) / 1e6,
            "slowest": [{"module": name, "self_s": s / 1e6, "cumulative_s": c / 1e6} for s, c, name in rows[:top]]}


def build_native(work: Path, pkg: Path, lib: Path, cuda: bool) -> Path:
    """The C++ program above, linked to libtorch's libraries (every one kept: linkers drop unreferenced
    ones by default, and CUDA's backend registers itself only when its library is loaded)."""
    src, exe = work / "start.cpp", work / "start"
    src.write_text(NATIVE_SOURCE)
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise SystemExit("--native needs a C++ compiler on PATH (or $CXX)")
    libs = ["-lc10", "-ltorch_cpu", "-ltorch"] + (["-lc10_cuda", "-ltorch_cuda"] if cuda else [])
    cmd = [cxx, "-std=c++17", "-O1", str(src), "-o", str(exe), f"-I{pkg / 'include'}",
           f"-I{pkg / 'include' / 'torch' / 'csrc' / 'api' / 'include'}", f"-L{lib}", f"-Wl,-rpath,{lib}",
           "-Wl,--no-as-needed", *libs]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return exe


def probe(repeats: int, native: bool, device: str) -> dict[str, Any]:
    py = sys.executable
    pkg, lib = torch_dirs()
    cuda = device == "cuda"
    out: dict[str, Any] = {"python": py, "torch_dir": str(pkg), "device": device, "repeats": repeats, "rows": {}}
    rows = out["rows"]
    rows["python -c pass"] = median_wall([py, "-c", "pass"], repeats)
    load = "import ctypes, sys; [ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL) for p in sys.argv[1:]]"
    rows["libtorch's libraries alone (ctypes)"] = median_wall([py, "-c", load, *map(str, libraries(lib))], repeats)
    rows["import torch"] = median_wall([py, "-c", "import torch"], repeats)
    if cuda:
        first = "import torch; torch.ones(1, device='cuda').sum().item()"
        rows["import torch + one CUDA tensor"] = median_wall([py, "-c", first], repeats)
    with tempfile.TemporaryDirectory() as prefix:
        # bytecode written there even where the environment says not to (PYTHONDONTWRITEBYTECODE: set here)
        env = {"PYTHONPYCACHEPREFIX": prefix, "PYTHONDONTWRITEBYTECODE": ""}
        rows["import torch, fresh PYTHONPYCACHEPREFIX (compiles)"] = wall([py, "-c", "import torch"], env)[0]
        rows["import torch, that prefix again (reads it)"] = median_wall([py, "-c", "import torch"], repeats, env)
    out["bytecode"] = bytecode_census(pkg)
    stderr = subprocess.run([py, "-X", "importtime", "-c", "import torch"], capture_output=True, text=True,
                            check=True).stderr
    out["importtime"] = slowest_imports(stderr)
    if native:
        with tempfile.TemporaryDirectory() as work:
            t = time.perf_counter()
            try:
                exe = build_native(Path(work), pkg, lib, cuda)
            except (subprocess.CalledProcessError, SystemExit) as e:  # the rows above still count
                out["native_error"] = str(getattr(e, "stderr", "") or e)[-2000:]
                return out
            out["native_build_s"] = time.perf_counter() - t
            runs = [wall([str(exe), device]) for _ in range(repeats)]
            rows[f"C++ linked to libtorch, one {device} tensor"] = statistics.median(s for s, _ in runs)
            out["native_first_tensor_s"] = statistics.median(float(p.split()[0]) for _, p in runs)
    return out


def table(out: dict[str, Any]) -> str:
    lines = [f"{'start-up of a new process':58s} {'seconds':>8s}"]
    lines += [f"{name:58s} {s:8.3f}" for name, s in out["rows"].items()]
    b = out["bytecode"]
    lines.append(f"torch's .py files {b['py_files']}, with current bytecode {b['with_bytecode']} "
                 f"({b['cache_tag']}), package writable: {b['package_writable']}, "
                 f"PYTHONDONTWRITEBYTECODE={b['PYTHONDONTWRITEBYTECODE']!r}")
    imp = out["importtime"]
    lines.append(f"importtime: {imp['modules']} modules, {imp['self_s_total']:.2f} s in themselves; slowest: "
                 + ", ".join(f"{r['module']} {r['self_s']:.2f}" for r in imp["slowest"][:5]))
    if "native_error" in out:
        lines.append(f"C++ program: not built: {(out['native_error'].strip().splitlines() or ['?'])[-1]}")
    if "native_first_tensor_s" in out:
        lines.append(f"C++ program: built in {out['native_build_s']:.0f} s; main() to its first tensor "
                     f"{out['native_first_tensor_s']:.3f} s (the rest of its row is loading the libraries)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--native", action="store_true", help="also build and time a C++ program linked to libtorch")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    device = args.device
    if device == "auto":  # asked of a child process: this one must not import torch
        device = wall([sys.executable, "-c", "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')"])[1]
    out = probe(args.repeats, args.native, device)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "startup-probe.json").write_text(json.dumps(out, indent=1) + "\n")
    print(table(out))


if __name__ == "__main__":
    main()
