"""The device's measured ceilings: copy bandwidth and matmul rate, the two roofs a kernel is judged against.

Datasheet peaks are leads, not measurements: a copy kernel reaches ~90% of an H100's HBM datasheet figure and
a large bf16 matmul ~70% of its dense tensor-core figure. The benchmark (benchmarks/bench.py) and
`trtbuild profile` both use `measure`, so a profile's shares of the roofs are the benchmark's floors. A
profile reads them from a small per-device cache (`cached`), measured once.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# (bytes copied, matmul side): a copy large enough to stream from DRAM and not from the last-level cache,
# a matmul large enough to reach the tensor cores' steady rate. The CPU's are sized to take about a second on
# two cores: a profile in CI probes its device once per store.
GPU_PROBE = (2 << 30, 8192)
CPU_PROBE = (64 << 20, 512)


def time_op(fn: Callable[[], Any], device: str, reps: int, warmup: int = 3) -> list[float]:
    """Seconds per call: CUDA events around each call on a GPU, perf_counter on the CPU."""
    import torch

    for _ in range(warmup):
        fn()
    cuda = device.startswith("cuda")
    out = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fn(); b.record(); b.synchronize()  # noqa: E702
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter(); fn(); out.append(time.perf_counter() - t)  # noqa: E702
    return out


def measure(device: str, copy_bytes: int, matmul_n: int) -> dict[str, Any]:
    """Copy bandwidth (bytes read + written per second) and the rate of an n^3 matmul (bf16 on a GPU, fp32 on
    the CPU: each device's usual engine precision), medians of many calls."""
    import torch

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32

    def copy_seconds() -> float:
        src = torch.randn(copy_bytes // 2, dtype=torch.bfloat16, device=device)
        dst = torch.empty_like(src)
        return statistics.median(time_op(lambda: dst.copy_(src), device, 50))

    t_copy = copy_seconds()  # its buffers freed on return, before the matmul inputs
    n = matmul_n
    mats = [(torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device))
            for _ in range(3)]  # rotate among inputs so no run times a cache-warm repeat
    it = iter(range(10**9))
    t_mm = statistics.median(time_op(lambda: torch.mm(*mats[next(it) % 3]), device, 30))
    return {"copy_bytes": copy_bytes, "copy_s": t_copy, "copy_Bps": 2 * copy_bytes / t_copy,
            "copy_note": "bytes read + written", "matmul_n": n, "matmul_dtype": str(dtype).replace("torch.", ""),
            "matmul_s": t_mm, "matmul_flops_per_s": 2 * n**3 / t_mm}


def device_name(device: str) -> str:
    """What the ceilings belong to: the GPU's name, or the CPU's model and the cores torch uses."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model or 'cpu'} x{torch.get_num_threads()}"


def cached(device: str, folder: Path, *, fresh: bool = False) -> dict[str, Any]:
    """The ceilings of this device, measured once and kept in `folder` (one JSON file a device and torch
    version); `source` says whether they were measured now or read back, and when read back, how old they are and
    how to measure them again (roofs measured on a busy machine are low, and every verdict leans on them).
    `fresh` measures them again and replaces the file."""
    import torch

    name = device_name(device)
    slug = re.sub(r"[^a-z0-9]+", "-", f"{name} torch {torch.__version__}".lower()).strip("-")
    path = folder / f"{slug}.json"
    if path.is_file() and not fresh:
        try:
            found: dict[str, Any] = json.loads(path.read_text())
        except (OSError, ValueError):
            pass  # a damaged cache file is measured again and replaced
        else:
            when = float(found.get("measured_at") or path.stat().st_mtime)
            return found | {"source": f"cached in {path}, measured {_age(time.time() - when)} ago; "
                                      "`trtbuild profile --remeasure` measures them again"}
    copy_bytes, n = GPU_PROBE if device.startswith("cuda") else CPU_PROBE
    result = measure(device, copy_bytes, n) | {"device_name": name, "torch": torch.__version__,
                                               "measured_at": time.time()}
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)  # atomic: a concurrent profile reads the old file or the new, never half of one
    return result | {"source": f"measured now, kept in {path}"}


def _age(seconds: float) -> str:
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n > 1 else ''}"
    return "less than a minute"


def implausible(result: dict[str, Any], slack: float = 1.05) -> list[str]:
    """The call sites of a profile that ran faster than a roof allows: the roofs, not the kernels, are wrong
    (measured while the machine was busy), and every verdict against them with them."""
    return [f"{name}: {r['site']}" for name, phase in result.get("phases", {}).items() for r in phase["rows"]
            if (r.get("bw_fraction") or 0.0) > slack or (r.get("flops_fraction") or 0.0) > slack]
