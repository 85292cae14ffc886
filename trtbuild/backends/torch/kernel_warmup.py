"""The decode matmul's candidate kernels compiled in parallel, before the build times them one by one.

Why: tactic selection times every candidate configuration of trtbuild's decode matmul at every weight shape,
fusion and batch bucket (`decode_kernels.matmul_plan`). Each (configuration, fusion, batch) is a kernel of
its own that Triton compiles the first time it is launched, one after another in the build's process, and
each fused call site also has its unfused rival compiled by Inductor. On an H100 (2026-12-06) the 1B
engine's selection took 82 s of a 208 s cold build, nearly all of it compiling (a launch to time takes
microseconds). Compiling is CPU work that parallelizes: worker processes launch each candidate once on
inputs of the same shapes, which writes the compiled kernels into Triton's and Inductor's on-disk caches
(the build points both at its tactic cache), and the timing that follows in the build's process loads them
from there instead of compiling.

Nothing here decides anything: the timings are taken afterwards exactly as before, so a worker that fails,
or a kernel it did not reach, only costs the compile it would have saved. Not a build module: it changes no
engine, so it is not part of the engine-code digest.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import time
from collections.abc import Callable
from typing import Any

# (rows, n, k, fusion, dtype name, configuration names): one call site's candidates at one batch
Work = tuple[int, int, int, str, str, tuple[str, ...]]

LIMIT_S = 300.0  # past this the workers are abandoned and the timing compiles what is left itself


def workers_for(tasks: int) -> int:
    """Processes to compile with: the cores this process may use, less one for the build itself, at most 16
    (each holds a CUDA context and a copy of the inputs) and at most one per task."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(0, min(16, cores - 1, tasks))


def precompile(work: list[Work], device: str, progress: Callable[[str], None]) -> dict[str, Any]:
    """Launch every candidate of `work` once in worker processes; returns what was done, for the manifest.
    Takes no decision and raises nothing: whatever fails here is compiled again by the timing."""
    tasks = [(rows, n, k, fusion, dtype, config) for rows, n, k, fusion, dtype, configs in work for config in configs]
    n_workers = workers_for(len(tasks))
    if not tasks or n_workers < 2 or not device.startswith("cuda"):
        return {"kernels": 0, "workers": 0}
    progress(f"compiling {len(tasks)} decode-matmul candidates in {n_workers} processes before timing them")
    t = time.perf_counter()
    shares = [tasks[i::n_workers] for i in range(n_workers)]
    done, failed = 0, 0
    # spawn: a forked child of a process that has initialized CUDA cannot use it
    pool = cf.ProcessPoolExecutor(n_workers, mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = [pool.submit(_compile_share, share, device) for share in shares]
        for f in cf.as_completed(futures, timeout=LIMIT_S):
            ok, bad = f.result()
            done, failed = done + ok, failed + bad
    except Exception as e:  # a worker that died or hung: the timing compiles what it did not
        progress(f"compiling ahead stopped ({type(e).__name__}: {e}); the timing compiles the rest")
        failed = len(tasks) - done
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return {"kernels": done, "failed": failed, "workers": n_workers, "seconds": round(time.perf_counter() - t, 1)}


def _compile_share(share: list[tuple[int, int, int, str, str, str]], device: str) -> tuple[int, int]:
    """In a worker: launch each (rows, n, k, fusion, dtype, configuration) once, as `decode_matmul.select`
    launches it (the same argument shapes, dtypes and alignment, so Triton specializes it the same way), and
    each fused site's unfused rival once through torch.compile. Returns (launched, failed)."""
    import torch

    from trtbuild.kernels import decode_matmul as dm
    from trtbuild.kernels.fusions import GAINED, GATED, NORMED
    from trtbuild.kernels.matmul_configs import MatmulConfig

    torch.cuda.set_device(torch.device(device))
    inputs: dict[tuple[int, int, int, str, str], tuple[Any, ...]] = {}
    rivals: set[tuple[int, int, int, str, str]] = set()
    ok = bad = 0
    for rows, n, k, fusion, dtype_name, config in share:
        site = (rows, n, k, fusion, dtype_name)
        if site not in inputs:
            dtype = getattr(torch, dtype_name.removeprefix("torch."))
            w = torch.randn(n, k, device=device, dtype=dtype)
            x = torch.randn(rows, k, device=device, dtype=dtype)
            norm = (torch.rand(k, device=device, dtype=dtype) + 0.5 if fusion in GAINED else
                    torch.ones(k, device=device, dtype=dtype) if fusion in NORMED else None)
            width = dm.output_columns(w, fusion in GATED)
            residual = torch.randn(rows, width, device=device, dtype=dtype) if fusion == "residual" else None
            inputs[site] = (x, w, torch.empty(rows, width, device=device, dtype=dtype), norm, residual)
        x, w, y, norm, residual = inputs[site]
        try:
            dm.decode_matmul(x, w, MatmulConfig.parse(config), out=y, norm=norm if fusion in GAINED else None,
                             eps=1e-5, gate=fusion in GATED, residual=residual, rms=fusion in NORMED)
            ok += 1
        except Exception:  # a configuration that does not compile here: the timing records it
            bad += 1
        if fusion != "none" and site not in rivals:
            rivals.add(site)
            try:
                with torch._dynamo.config.patch(recompile_limit=256):
                    torch.compile(dm.reference, dynamic=False, fullgraph=True)(x, w, fusion, norm, 1e-5, residual)
            except Exception:
                pass
    torch.cuda.synchronize()
    return ok, bad
