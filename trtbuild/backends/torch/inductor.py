"""How the torch backend drives Inductor: its options per tactics level and graph, where its caches
live during a build, and the GEMM selections it benchmarks. Shared by the build process and the
compile workers (compile_workers.py), which must compile exactly as the build process would."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# precision -> the dtype the graphs compute in; the quantized precisions' weights are stored smaller
# (models/quantize.py) and their activations, KV cache, embeddings and LM head are bf16
DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
               "fp8": "bfloat16", "int8_wo": "bfloat16", "int4_wo": "bfloat16"}


def inductor_configs(level: str, device: str, graph: str = "decode") -> dict[str, Any]:
    """Inductor options per tactics level, for one graph (`prefill` or a `decode_b<N>`).

    none: no kernel benchmarking at all (fastest build). default: Inductor's defaults (cuBLAS for
    every matmul; Triton configs of the other kernels benchmarked). max: also max-autotune for the
    decode graphs, which benchmarks Triton GEMM templates against cuBLAS for every matmul shape and
    keeps the faster. Their GEMM shapes are exact (the batch is static; a weight is N x K), so what
    is measured at build is what runs. The prefill graph keeps `default` at every level above none:
    its rows (batch x prompt length) are dynamic, and Inductor would benchmark the templates at the
    export's example size (4 rows) and keep that winner for 2048-row prompts, where cuBLAS picks its
    kernel per call.

    Coordinate descent is in neither: with it on, Inductor rewrites every batch-1 matmul as a Triton
    GEMV reduction, and on the H200 (2026-12-03, 1B shape) those ran at 2.1-3.5 TB/s against cuBLAS's
    2.7-4.3, made the batch-1 decode step slower than the batch-8 one (1.55 vs 1.26 ms) and cost most
    of a 282 s build. max-autotune keeps cuBLAS wherever cuBLAS measures faster.

    On the CPU, `max` keeps ATen's matmuls: Inductor's C++ GEMM template packs constant weights into
    new constants at compile time, which a graph whose weights are handed in at load never receives
    (the engine then refuses to load, naming the missing constants).
    """
    base: dict[str, Any] = {"aot_inductor.package_constants_in_so": False, "always_keep_tensor_constants": True}
    from trtbuild.backends.torch import cxx

    base["cpp.cxx"] = (None, cxx.compiler().path)  # exactly the compiler the key records
    # Inductor proves each vector ISA the CPU reports (AVX2, AVX-512, AVX-512 VNNI, AMX) by compiling ATen's
    # vector headers once per ISA and loading each result in a new Python process, once in every process that
    # compiles, under one file lock per ISA. On the CPU that was 10 of 12 CPU seconds of its ISA probe, a fifth
    # of a tiny build's CPU time (2 cores, 2026-12-06). A CUDA program asks too (AOTInductor records the ISA
    # in its metadata): on an H200 (0741706) each compiled program spent 42-61 s in AotCodeCompiler.compile of
    # which the compiler ran 4-6 s, the rest outside it, in the seven processes compiling side by side that
    # each import torch per ISA behind those locks. The CPU's own flags (cpuinfo, which also checks that the
    # OS saves the registers) decide instead; the compiler's support for the extensions (bf16, VNNI, AMX
    # tiles) is still compiled and checked, and a compiler that could not build the base ISA fails loudly.
    # Those extension checks load their test library in a new Python process too, under the same locks: on an
    # H100 host (f09d588) each CUDA program still spent 26-42 s in AotCodeCompiler.compile where its kernels'
    # compile and link took 0.6-0.7 s (the wrapper's, beside them, ~5 s). A CUDA program has no CPU kernels
    # to vectorize, so its builds take no vector ISA at all (False: every check is skipped, none compiled).
    base["cpp.vec_isa_ok"] = not device.startswith("cuda")
    if graph.startswith("decode_b") and pdl_compilable(device):
        # Inductor's kernels wait for their predecessor inside the kernel, so the runtime may let them
        # start early in the captured decode step (trtbuild/backends/torch/pdl.py). The prefill graphs' captures
        # are not edited for it: it would gain them nothing.
        base["triton.enable_pdl"] = True
    if not graph.startswith("paged") or not device.startswith("cuda"):  # see quick_wrapper: CPU programs too
        base |= quick_wrapper()
    if level == "none":
        return base | {"max_autotune": False, "coordinate_descent_tuning": False, "triton.autotune_pointwise": False}
    if level == "default" or not graph.startswith("decode_b"):  # prefill, paged: dynamic rows
        return base
    tuned = base | {"max_autotune": True, "coordinate_descent_tuning": False}
    return tuned if device.startswith("cuda") else tuned | {"max_autotune_gemm_backends": "ATEN"}


def quick_wrapper() -> dict[str, Any]:
    """Inductor options that make the C++ compiler's share of a CUDA graph's build smaller: its host wrapper
    (one function that launches every kernel of the unrolled model) compiled at -O0 instead of -O1, with no
    line tables. That wrapper's speed only matters where the host issues the graph call by call: the decode
    steps and the prefill are replayed from captured CUDA graphs (the wrapper runs once, at capture), so
    only a prefill called directly (TRTBUILD_PREFILL_GRAPHS=0) pays it. The paged graphs, called directly, keep
    Inductor's defaults. A 1B bf16 build on an H100 spent 72 s of 187 in the C++ compiler (2026-12-06).
    A CPU program's wrapper is compiled so too, whatever the graph: on 2 cores its compile is the C++ phase's
    longest part (the kernels' object compiles beside it), and a cold tiny-llama build took 14.4-14.7 s against
    15.8-16.0 s (three builds each, alternated, 2026-12-07), for 16 µs more host time a decode step (tiny-llama's
    TPOT p50 0.040 -> 0.056 ms): small beside a real model's CPU step of milliseconds.
    Options a torch lacks are left out."""
    from torch._inductor import config

    wanted = {"compile_wrapper_opt_level": "O0", "enable_line_tables": False}
    return {f"aot_inductor.{k}": v for k, v in wanted.items() if hasattr(config.aot_inductor, k)}


def pdl_compilable(device: str) -> bool:
    """Whether Inductor compiles the PDL wait into its kernels for `device`: a Hopper or later GPU, and an
    Inductor with the option. TRTBUILD_INDUCTOR_PDL=0 says no (a diagnostic switch: the runtime then lets
    only trtbuild's own kernels start early, as the engine spec records; the key records it through
    fingerprint.compile_environment)."""
    if os.environ.get("TRTBUILD_INDUCTOR_PDL", "1") == "0" or not kernels_wait(device):
        return False
    import torch

    return hasattr(torch._inductor.config.triton, "enable_pdl")


def kernels_wait(device: str) -> bool:
    """Whether trtbuild's decode kernels are compiled with the PDL wait for `device`: the test their
    launchers make (models/grid_dependency.py), a Hopper or later GPU."""
    if not device.startswith("cuda"):
        return False
    try:
        from trtbuild.kernels.grid_dependency import waits_on
    except ImportError:  # no Triton: no trtbuild kernels either
        return False
    return waits_on(device)


def prepare_cpu(configs: dict[str, Any]) -> None:
    """Inductor's one-time set-up of a process, for a CPU build, done once before the build forks
    (compile_workers.Forks) so that the children inherit it instead of each paying it again: the imports of
    its compiler and lowerings, the joint-graph pattern matcher's patterns, and the vector-ISA extension
    checks (6 compiles of ATen's vector headers and 6 processes that load them: 2.6 s of a cold build on
    2 cores, 2026-12-06). Called outside `inductor_caches`, those checks' compiled files live in Inductor's
    host-wide cache, beside its precompiled headers: a later cold build only loads them again (0.4 s).
    `configs` are the build's Inductor options, under which the checks run as the compiles would."""
    import torch
    from torch._inductor import compile_fx, config, cpu_vec_isa, lowering  # noqa: F401  (imported for the fork)
    from torch._inductor.fx_passes import joint_graph, post_grad

    with config.patch(dict(configs)):
        cpu_vec_isa.pick_vec_isa()
        joint_graph.lazy_init(torch.device("cpu"))  # keyed by the graph's input device, as compile_fx calls it
        post_grad.lazy_init()


@contextlib.contextmanager
def compile_parts(out: dict[str, Any]) -> Iterator[None]:
    """Where one AOTInductor compile's seconds went, read from Inductor's own timers
    (`torch._dynamo.utils.compilation_time_metrics`): `cxx_s` the C++ compile and link of the graph's
    wrapper and kernels (AotCodeCompiler.compile), `inductor_s` the rest (tracing, lowering, code
    generation, packaging; the first graph of a process also probes the CPU's vector ISAs there), and
    `timers`: every one of Inductor's timers that ran for 0.1 s or more, nested ones
    included (so they overlap), to say what inside those two parts took the time. Only the total where
    this torch keeps no such timer."""
    try:
        from torch._dynamo.utils import compilation_time_metrics as metrics
    except ImportError:
        metrics = {}
    before = {k: sum(v) for k, v in metrics.items()}
    t = time.perf_counter()
    try:
        yield
    finally:
        total = time.perf_counter() - t
        spent = {k: sum(v) - before.get(k, 0.0) for k, v in metrics.items()}
        cxx = spent.get("AotCodeCompiler.compile", 0.0)
        out.update({"cxx_s": cxx, "inductor_s": total - cxx,
                    "timers": {k: round(s, 3) for k, s in sorted(spent.items(), key=lambda x: -x[1]) if s >= 0.1}})


@contextlib.contextmanager
def inductor_caches(path: Path) -> Iterator[None]:
    """Point Inductor's and Triton's caches (compiled kernels, autotune choices) at the tactic cache."""
    wanted = {"TORCHINDUCTOR_CACHE_DIR": str(path / "inductor"), "TRITON_CACHE_DIR": str(path / "triton")}
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def record_autotuning(out: list[dict[str, Any]]) -> Iterator[None]:
    """Collect every GEMM selection Inductor benchmarks: the candidates, their times, the winner.

    Inductor also prints each selection's table to stderr (pages of them for a model at tactics
    `max`); the manifest keeps the same facts, so the tables are shown only with TRTBUILD_DEBUG=1.
    """
    from torch._inductor import config
    from torch._inductor import select_algorithm as sa

    quiet = os.environ.get("TRTBUILD_DEBUG") != "1"
    was_printing = getattr(sa, "PRINT_AUTOTUNE", None)
    if quiet and was_printing is not None:
        sa.PRINT_AUTOTUNE = False
    stats_flag = "max_autotune_report_choices_stats"  # its "Autotune Choices Stats" lines (not in every torch)
    stats = {stats_flag: False} if quiet and hasattr(config, stats_flag) else {}

    def saver(timings: dict[Any, float], name: str, *rest: Any) -> None:
        ranked = sorted(((getattr(c, "name", str(c)), float(t)) for c, t in timings.items()), key=lambda x: x[1])
        if ranked:
            out.append({"op": name, "candidates": [{"choice": n, "ms": t} for n, t in ranked[:8]],
                        "num_candidates": len(ranked), "winner": ranked[0][0], "winner_ms": ranked[0][1]})

    sa.add_feedback_saver(saver)
    try:
        with config.patch(stats):
            yield
    finally:
        sa.clear_feedback_savers()
        if was_printing is not None:
            sa.PRINT_AUTOTUNE = was_printing
