"""Worker processes that compile a torch build's graphs side by side.

AOTInductor compiles one graph at a time, mostly in one Python thread, and a build has several: an 8B
build on the H200 spent 127 s on its prefill graph and 60-170 s on each decode graph, one after another.
The graphs are independent, and what Inductor makes of one depends on the exported program and the
Inductor options alone (the compiled-graph cache is keyed by exactly those), not on the weights. So a
worker rebuilds the model with random weights (no checkpoint is read), exports its one graph, checks that
the program's cache key is the one the build computed, compiles it and publishes it into the tactic
cache. The build meanwhile compiles its first missing graph itself, then waits for each worker and
copies that graph from the cache. A worker that fails, or whose export came out different, costs only
its time: the build compiles that graph itself.

Timing stays honest: Inductor times its kernel configurations on the GPU while it compiles, and two
processes timing at once would each measure the other's kernels too. So while workers run, every GPU
timing of Inductor's, in the build and in each worker, holds one lock (`timing_alone`): the compiling
overlaps, the timings take turns. Each worker holds a copy of the model on the build's device, so the
count is capped by free memory. `TRTBUILD_COMPILE_WORKERS=0` compiles every graph in the build process;
a number caps the workers; `auto` (the default) uses them where the host has at least 4 CPU cores.

A CPU build forks instead (`Forks`): no GPU is involved, so a child of the build process after export has
the modules imported, the model and every exported program already, and does only Inductor and the C++
compiler. A worker process pays about 13 CPU s of that set-up again (tiny-llama on 2 cores, 2026-12-06),
as long as the graph it compiles; a fork pays none of it, so it pays even on 2 cores.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace, TracebackType
from typing import Any

from trtbuild.errors import TrtbuildError

ENV = "TRTBUILD_COMPILE_WORKERS"
TIMING_LOCK = "gpu-timing.lock"  # in the tactic cache folder, which every process of one build shares


def worker_count(missing: int, model_bytes: int, device: str) -> int:
    """How many graphs besides the build's own to hand to workers, when `missing` graphs need compiling."""
    wanted = os.environ.get(ENV, "auto").strip().lower()
    if wanted != "auto":
        try:
            cap = int(wanted)
            if cap < 0:
                raise ValueError
        except ValueError:
            raise TrtbuildError(f"environment variable {ENV}: expected 'auto' or a whole number >= 0, "
                                f"got {wanted!r}") from None
        return min(cap, max(missing - 1, 0))
    cpus = os.cpu_count() or 1
    if device == "cpu":
        # Forks: no set-up to pay again, no second copy of the model. Up to twice the cores: each compile is
        # partly waiting on its C++ compiler's process, and a build that hands a fork only the next graph
        # leaves cores idle while it waits for that one (SmolLM2 by regions, 4 programs on 2 cores: 60.8 s
        # with one fork, 40.5 s with three, 2026-12-06).
        return max(0, min(missing - 1, 2 * cpus - 1))
    if cpus < 4 or missing < 2:  # on 2 cores a second Inductor only takes turns with the first
        return 0
    # Each worker holds the model again; leave a fifth of what is free for compiling and tuning. Up to a worker
    # for two cores: a program compiled by regions is mostly its C++ compile, one thread (a 1B bf16 build on an
    # H100 spent 50 of its 67 s of compiling in the C++ compiler, the build's own two programs of six, with
    # four workers, 2026-12-06).
    free = _free_device_bytes(device)
    by_memory = int(free * 0.8 // max(model_bytes, 1)) if free is not None else missing - 1
    return max(0, min(missing - 1, cpus // 2, by_memory))


def _free_device_bytes(device: str) -> int | None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()  # blocks the build's caching allocator keeps but no longer uses
        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


class Workers:
    """The build's worker processes, each compiling the units it is handed in turn (its set-up paid once); every
    one still running is ended on exit."""

    def __init__(self, folder: Path, threads_each: int) -> None:
        self.folder = folder
        self.threads_each = threads_each
        self.running: dict[str, subprocess.Popen[bytes]] = {}  # unit -> the process compiling it
        self.logs: dict[subprocess.Popen[bytes], Path] = {}  # process -> its output

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for proc in set(self.running.values()):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.running.clear()

    def start(self, spec: dict[str, Any]) -> None:
        """Start compiling `spec["units"]` (the spec is described at `run`) in a new process."""
        self.folder.mkdir(parents=True, exist_ok=True)
        name = spec["units"][0]["unit"]
        path = self.folder / f"{name}.json"
        path.write_text(json.dumps(spec | {"results": str(self.folder), "parent": os.getpid()}))
        env = dict(os.environ)
        # Inductor sizes its own compile pool by the CPU count; split the cores between the processes.
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(self.threads_each))
        with open(self.folder / f"{name}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "trtbuild.backends.torch.compile_workers", str(path)],
                                    stdout=log, stderr=subprocess.STDOUT, env=env)
        self.running.update({u["unit"]: proc for u in spec["units"]})
        self.logs[proc] = self.folder / f"{name}.log"

    def wait(self, name: str) -> dict[str, Any] | None:
        """The worker's report for unit `name` once its process has ended: {"ok": True, "compile_s", "total_s"
        (the unit's export and compile), "tuned"} or {"ok": False, "error"};
        None if no worker had that unit."""
        if name not in self.running:
            return None
        proc = self.running.pop(name)
        rc = proc.wait()
        result = self.folder / f"{name}.result.json"
        if result.is_file():
            return json.loads(result.read_text()) | {"ok": True}
        log = self.logs[proc]
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.is_file() else []
        return {"ok": False, "error": f"exit status {rc}: " + " | ".join(tail)}


def forks_for(device: str) -> bool:
    """Whether a build for `device` compiles in forks of itself (`Forks`) rather than in new processes
    (`Workers`): on the CPU only, as a process that has used CUDA cannot use it again in a fork."""
    return device == "cpu"


class Forks:
    """Graphs compiled in forked children of the build process, each child compiling the units it is handed in
    turn; every child still running is ended on exit (`forks_for` says where)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.running: dict[str, int] = {}  # unit -> the process id of the child compiling it
        self.ended: dict[int, int] = {}  # process id -> its exit status, once reaped
        self.logs: dict[int, Path] = {}  # process id -> its output

    def __enter__(self) -> "Forks":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for pid in set(self.running.values()) - set(self.ended):
            with contextlib.suppress(OSError):
                os.kill(pid, 9)
                os.waitpid(pid, 0)
        self.running.clear()

    def start(self, names: str | list[str], work: Callable[[], dict[str, Any]]) -> None:
        """Call `work` in a forked child; its result (JSON) comes back through `wait(name)`. With a list of
        names, `work` returns each one's result by name."""
        self.folder.mkdir(parents=True, exist_ok=True)
        group = [names] if isinstance(names, str) else names
        log = self.folder / f"{group[0]}.log"
        parent = os.getpid()
        pid = os.fork()
        if pid:
            self.running.update({n: pid for n in group})
            self.logs[pid] = log
            return
        # The child: never returns into the build's own code, and never runs its exit handlers.
        status = 1
        try:
            started = time.perf_counter()
            out_file = open(log, "w", buffering=1)
            os.dup2(out_file.fileno(), 1)  # the build's stdout carries its --json report: keep the child's out of it
            os.dup2(out_file.fileno(), 2)  # (the compilers' output too, written to the descriptors)
            sys.stdout = sys.stderr = out_file
            _end_with_parent(parent)
            import torch

            # The parent's OpenMP thread pool did not come with the fork, and libgomp waits for it forever at the
            # next parallel region (a SmolLM2 build's child hung in a tensor copy, 2026-12-06); one thread runs
            # no parallel region. The child only compiles: its tensor work is small copies.
            torch.set_num_threads(1)
            out = work()
            for name, report in ({names: out} if isinstance(names, str) else out).items():
                (self.folder / f"{name}.result.json").write_text(
                    json.dumps(report | {"total_s": time.perf_counter() - started}))
            status = 0
        except BaseException:  # reported through the log; the build then compiles the graph itself
            import traceback

            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(status)

    def wait(self, name: str) -> dict[str, Any] | None:
        """The child's report for `name` once it has ended (as `Workers.wait`); None if no child had it."""
        if name not in self.running:
            return None
        pid = self.running.pop(name)
        if pid not in self.ended:
            self.ended[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        result = self.folder / f"{name}.result.json"
        if self.ended[pid] == 0 and result.is_file():
            return json.loads(result.read_text()) | {"ok": True}
        log = self.logs[pid]
        tail = log.read_text(errors="replace").strip().splitlines()[-3:] if log.is_file() else []
        return {"ok": False, "error": f"exit status {self.ended[pid]}: " + " | ".join(tail)}


@contextlib.contextmanager
def timing_alone(lock: Path) -> Iterator[None]:
    """Every GPU timing Inductor makes in this process holds an exclusive lock on `lock` (a file), so
    processes that compile side by side never time kernels on the GPU at the same time.

    Inductor times through one object, `torch._inductor.runtime.benchmarking.benchmarker`, whose
    `benchmark` dispatches to `benchmark_gpu`; the lock wraps that method on the object, and its
    CUDA-graph variant. A torch without them times unlocked (nothing to wrap).
    """
    import fcntl

    from torch._inductor.runtime import benchmarking

    bench = benchmarking.benchmarker
    names = [n for n in ("benchmark_gpu", "benchmark_gpu_with_cuda_graph") if hasattr(bench, n)]
    own = {n: vars(bench)[n] for n in names if n in vars(bench)}

    def locked(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            with open(lock, "a") as handle:  # closing the file releases the lock
                fcntl.flock(handle, fcntl.LOCK_EX)
                return fn(*args, **kwargs)
        return call

    lock.parent.mkdir(parents=True, exist_ok=True)
    for name in names:
        setattr(bench, name, locked(getattr(bench, name)))
    try:
        yield
    finally:
        for name in names:
            if name in own:
                setattr(bench, name, own[name])
            else:
                delattr(bench, name)


def _end_with_parent(parent: int) -> None:
    """A worker whose build died (killed, crashed) stops too, instead of compiling for nobody. The build
    names itself in the spec: a build killed right after starting its workers is gone before they look."""

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(3)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()


def run(spec: dict[str, Any]) -> None:
    """Export and compile each unit `spec` hands this worker; publish each into the tactic cache, and its report
    into `spec["results"]/<unit>.result.json`. A unit that fails is reported on stderr and left to the build.

    spec: folder (the model folder, for config.json), precision, device, max_batch_size, max_input_len,
    max_seq_len, level (tactics level), attention (Attention.decode_kernel), prefill_attention
    (Attention.prefill_kernel, for a prefill graph), step (export.shared_step), tactics (the
    tactic cache folder), and units: each {"graph" ("prefill" or "decode_b<N>"), "unit" (the compiled unit's
    name: the graph's, or "<graph>.r<k>" for a region), "layer" (the layer whose region is compiled, or null),
    "matmuls" ({"<out>x<in>[+fusion]": configuration name} for trtbuild's decode matmul), "workdir" (a folder
    of its own), "digest" (the cache key the build computed for it)}.
    """
    import torch

    from trtbuild.backends.torch import export, moe_plan
    from trtbuild.backends.torch.inductor import DTYPE_NAMES
    from trtbuild.models.calibrate import empty_quantized
    from trtbuild.models.checkpoint import convert_hf_state_dict, hf_parameter_shapes, read_config
    from trtbuild.models.quantize import FORMATS

    _, cfg = read_config(Path(spec["folder"]))
    dtype = getattr(torch, DTYPE_NAMES[spec["precision"]])
    shapes = SimpleNamespace(max_batch_size=spec["max_batch_size"], max_input_len=spec["max_input_len"],
                             max_seq_len=spec["max_seq_len"])
    # Uninitialized weights, on the CPU like the build's own, through the same placement: what a graph
    # compiles to does not depend on the values, and the export must match the build's to the byte.
    hf = {k: torch.empty(shape, dtype=dtype) for k, shape in hf_parameter_shapes(cfg).items()}
    state = convert_hf_state_dict(hf, cfg)
    if spec["precision"] in FORMATS:  # quantized: the stored buffers' shapes and dtypes, not the dense weight's
        state = empty_quantized(state, FORMATS[spec["precision"]], spec.get("lm_head", "dense"))
    model = export.place_model(cfg, shapes, dtype, spec["device"], state)
    moe_plan.route(model, spec.get("moe_decode", "aten"))  # the build's choices for a mixture of experts
    moe_plan.route_prefill(model, spec.get("moe_prefill", "dense"))
    del state
    del hf
    for unit in spec["units"]:
        t = time.perf_counter()
        try:
            report = _compile_unit(model, shapes, spec, unit)
        except TrtbuildError as e:
            print(f"trtbuild compile worker: {e}", file=sys.stderr)
            continue
        report["total_s"] = time.perf_counter() - t
        (Path(spec["results"]) / f"{unit['unit']}.result.json").write_text(json.dumps(report))


def _compile_unit(model: Any, shapes: Any, spec: dict[str, Any], unit: dict[str, Any]) -> dict[str, Any]:
    """One unit of `run`: export it, check its cache key against the build's, compile and publish it."""
    from trtbuild.backends.torch import decode_kernels, export, graph_cache, inductor

    matmuls: dict[decode_kernels.MatmulKey, Any] = {}
    if unit["matmuls"]:
        from trtbuild.kernels.matmul_configs import MatmulConfig

        for key, name in unit["matmuls"].items():
            matmuls[decode_kernels.parse_key(key)] = MatmulConfig.parse(name)
    graph = export.export_graph(model, unit["graph"], shapes, spec["device"], matmuls, spec["attention"],
                                spec.get("prefill_attention", "sdpa"), tuple(spec.get("step", (0, 0))), unit["layer"])
    configs = inductor.inductor_configs(spec["level"], spec["device"], unit["graph"])
    digest = graph_cache.graph_digest(graph["program"], configs)
    if digest != unit["digest"]:
        raise TrtbuildError(f"{unit['unit']}: the worker's export has cache key {digest[:12]}, the build's "
                            f"{unit['digest'][:12]}; not compiled here")
    tuned: list[dict[str, Any]] = []
    t = time.perf_counter()
    with inductor.inductor_caches(Path(spec["tactics"])), inductor.record_autotuning(tuned), \
            timing_alone(Path(spec["tactics"]) / TIMING_LOCK):
        graph_cache.compile_or_reuse(graph, unit["unit"], configs, digest, Path(spec["tactics"]),
                                     Path(unit["workdir"]))
    return {"compile_s": time.perf_counter() - t, "tuned": tuned,
            **{k: graph[k] for k in graph_cache.COMPILE_PARTS if k in graph}}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    _end_with_parent(spec["parent"])
    for unit in spec["units"]:
        Path(unit["workdir"]).mkdir(parents=True, exist_ok=True)
    run(spec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
