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

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# (rows, n, k, fusion or stored format [+epilogue], inputs, configuration names): one call site's candidates at
# one batch.
# The inputs: the weights' dtype name for the dense kernel; for the quantized one, `layout` of a layer.
Work = tuple[int, int, int, str, Any, tuple[str, ...]]
FORMATS = ("fp8", "int8", "int4")  # the quantized kernel's stored formats (models/quantize.py)

LIMIT_S = 300.0  # past this the workers are abandoned and the timing compiles what is left itself


def layout(layer: tuple[Any, Any, Any]) -> tuple[tuple[tuple[int, ...], str] | None, ...]:
    """A quantized layer's (qweight, scale, zero) as shapes and dtype names, for a worker to make alike."""
    return tuple(None if t is None else (tuple(t.shape), str(t.dtype)) for t in layer)


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
    done = failed = 0
    # Processes of their own (as compile_workers.py runs its compiles), not a multiprocessing pool: a spawned
    # pool imports the parent's main module again, which for a script or `python -m` can be the whole CLI.
    with tempfile.TemporaryDirectory(prefix="trtbuild-warmup-") as tmp:
        procs = []
        for i in range(n_workers):
            share = Path(tmp) / f"share-{i}.json"
            share.write_text(json.dumps(tasks[i::n_workers]))
            procs.append((subprocess.Popen([sys.executable, "-m", "trtbuild.backends.torch.kernel_warmup",
                                            str(share), device], stdout=subprocess.DEVNULL,
                                           stderr=subprocess.DEVNULL), share))
        deadline = time.monotonic() + LIMIT_S
        for proc, share in procs:
            try:
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # abandoned: the timing compiles what it did not
                proc.kill()
                proc.wait()
            result = share.with_suffix(".done")
            if proc.returncode == 0 and result.is_file():
                ok, bad = json.loads(result.read_text())
                done, failed = done + ok, failed + bad
            else:
                failed += len(json.loads(share.read_text()))
    return {"kernels": done, "failed": failed, "workers": n_workers, "seconds": round(time.perf_counter() - t, 1)}


def _compile_share(share: list[tuple[int, int, int, str, Any, str]], device: str) -> tuple[int, int]:
    """In a worker: launch each (rows, n, k, fusion or format, inputs, configuration) once, as
    `decode_matmul.select` and `quant_matmul.select` launch it (the same argument shapes, dtypes and alignment,
    so Triton specializes it the same way), and each fused site's unfused rival once through torch.compile.
    Returns (launched, failed)."""
    import torch

    torch.cuda.set_device(torch.device(device))
    inputs: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    rivals: set[tuple[Any, ...]] = set()
    ok = bad = 0
    for rows, n, k, kind, spec, config in share:
        site = (rows, n, k, kind, spec)
        try:
            if kind.partition("+")[0] in FORMATS:  # a quantized site: its format and epilogue
                _launch_quantized(inputs, site, config, device)
            else:
                _launch_dense(inputs, rivals, site, config, device)
            ok += 1
        except Exception:  # a configuration that does not compile here: the timing records it
            bad += 1
    torch.cuda.synchronize()
    return ok, bad


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name.removeprefix("torch."))


def _launch_dense(inputs: dict[tuple[Any, ...], tuple[Any, ...]], rivals: set[tuple[Any, ...]],
                  site: tuple[Any, ...], config: str, device: str) -> None:
    import torch

    from trtbuild.kernels import decode_matmul as dm
    from trtbuild.kernels.fusions import GAINED, GATED, NORMED
    from trtbuild.kernels.matmul_configs import MatmulConfig

    rows, n, k, fusion, dtype_name = site
    if site not in inputs:
        dtype = _dtype(dtype_name)
        w = torch.randn(n, k, device=device, dtype=dtype)
        x = torch.randn(rows, k, device=device, dtype=dtype)
        norm = (torch.rand(k, device=device, dtype=dtype) + 0.5 if fusion in GAINED else
                torch.ones(k, device=device, dtype=dtype) if fusion in NORMED else None)
        width = dm.output_columns(w, fusion in GATED)
        residual = torch.randn(rows, width, device=device, dtype=dtype) if fusion == "residual" else None
        inputs[site] = (x, w, torch.empty(rows, width, device=device, dtype=dtype), norm, residual)
    x, w, y, norm, residual = inputs[site]
    if fusion != "none" and site not in rivals:
        rivals.add(site)
        try:
            with torch._dynamo.config.patch(recompile_limit=256):
                torch.compile(dm.reference, dynamic=False, fullgraph=True)(x, w, fusion, norm, 1e-5, residual)
        except Exception:  # the timing compiles it, or records why it cannot
            pass
    dm.decode_matmul(x, w, MatmulConfig.parse(config), out=y, norm=norm if fusion in GAINED else None,
                     eps=1e-5, gate=fusion in GATED, residual=residual, rms=fusion in NORMED)


def _launch_quantized(inputs: dict[tuple[Any, ...], tuple[Any, ...]], site: tuple[Any, ...], config: str,
                      device: str) -> None:
    import torch

    from trtbuild.kernels import quant_matmul as qm

    rows, n, k, kind, spec = site
    epilogue = kind.partition("+")[2] or "none"
    if site not in inputs:
        made = []
        for part in spec:  # the values do not matter to the compiler, only shapes, dtypes and alignment
            if part is None:
                made.append(None)
                continue
            shape, dtype = part[0], _dtype(part[1])
            t = torch.randn(shape, device=device).to(dtype) if dtype.is_floating_point else \
                torch.randint(0, 16, shape, device=device).to(dtype)
            made.append(t)
        x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        width = qm.output_columns(made[0], epilogue == "gate")
        y = torch.empty(rows, width, device=device, dtype=torch.bfloat16)
        inputs[site] = (x, *made, y, torch.randn_like(y) if epilogue == "residual" else None)
    x, q, s, z, y, residual = inputs[site]
    qm.quant_matmul(x, q, s, z, qm.MatmulConfig.parse(config), out=y, gate=epilogue == "gate", residual=residual)


def _frozen(value: Any) -> Any:
    """JSON's lists back to tuples, so a task's inputs can key a dict."""
    return tuple(_frozen(v) for v in value) if isinstance(value, list) else value


if __name__ == "__main__":  # a worker: python -m trtbuild.backends.torch.kernel_warmup SHARE.json DEVICE
    share_file = Path(sys.argv[1])
    share = [tuple(_frozen(v) for v in task) for task in json.loads(share_file.read_text())]
    share_file.with_suffix(".done").write_text(json.dumps(_compile_share(share, sys.argv[2])))
