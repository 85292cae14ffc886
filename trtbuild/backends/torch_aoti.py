"""The PyTorch AOTInductor backend: torch.export + AOTInductor, run on CPU or CUDA.

An entry holds one prefill graph (dynamic batch and prompt length, attention through SDPA's fused
causal kernels), one decode graph per batch bucket (static batch; dynamic in how many cache slots
attention reads), and the weights as one safetensors file in the engine's own fused layout and
dtype. Each graph is compiled by `aoti_compile_and_package` without its weights inside
(`package_constants_in_so=False`) and unpacked from the .pt2 into a folder holding the compiled
.so (and, on CUDA, its cubins). At load the weights and a KV cache that trtbuild allocates are
handed to every graph as user-managed constants, so prefill and decode share one cache and the
weights exist once on disk and once in device memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trtbuild.backends import BuildJob, BuildOutput, decode_kernels
from trtbuild.errors import TrtbuildError

DTYPE_NAMES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
WEIGHTS = "weights.safetensors"
ENGINE_JSON = "engine.json"
class TorchAOTIBackend:
    name = "torch"

    def check(self, recipe: Any) -> list[str]:
        problems = [f"options.{k}: unknown option for backend torch (known: {', '.join(decode_kernels.OPTIONS)})"
                    for k in recipe.options if k not in decode_kernels.OPTIONS]
        for name, modes in decode_kernels.OPTIONS.items():
            if recipe.options.get(name, "auto") not in modes:
                problems.append(f"options.{name}: expected one of {', '.join(modes)}, got {recipe.options[name]!r}")
        if recipe.options.get("decode_matmul") == "kernel" and recipe.tactics_level == "none":
            problems.append("options.decode_matmul: 'kernel' picks its configuration by timing, which tactics "
                            "level none turns off; use level default, or decode_matmul auto/cublas")
        if recipe.model.kind == "onnx":
            problems.append("model.source: the torch backend takes a Hugging Face model, not ONNX")
        return problems

    def toolchain(self) -> dict[str, str]:
        import torch

        from trtbuild.backends import cxx

        # The C++ compiler is part of the toolchain: it compiles every graph.
        tools = {"torch": torch.__version__, "cxx": cxx.compiler().version}
        if torch.cuda.is_available():
            from importlib import metadata

            tools["cuda"] = str(torch.version.cuda)
            # From the package metadata: importing triton costs a restart up to a second, for a string.
            try:
                tools["triton"] = metadata.version("triton")
            except metadata.PackageNotFoundError:
                import triton

                tools["triton"] = triton.__version__
        return tools

    # -- build -----------------------------------------------------------------------------------
    def build(self, job: BuildJob) -> BuildOutput:
        import torch

        from trtbuild.models.checkpoint import load_weights, read_config
        from trtbuild.models.llama import Transformer, convert_hf_state_dict

        recipe, shapes = job.recipe, job.recipe.shapes
        dtype = getattr(torch, DTYPE_NAMES[recipe.precision])
        device = "cuda" if job.device.get("kind") == "cuda" else "cpu"
        phases: dict[str, float] = {}

        t = time.perf_counter()
        folder = job.model.materialize()
        raw, cfg = read_config(folder)
        state = convert_hf_state_dict(load_weights(folder, cfg, dtype), cfg)
        phases["load_weights_s"] = time.perf_counter() - t

        t = time.perf_counter()
        from safetensors.torch import save_file

        stored = {k: v.contiguous() for k, v in state.items() if not (cfg.tie_word_embeddings and k == "output.weight")}
        save_file(stored, str(job.workdir / WEIGHTS))
        phases["write_weights_s"] = time.perf_counter() - t

        with torch.device(device):
            model = Transformer(cfg, shapes.max_batch_size, shapes.max_seq_len, dtype)
        model.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=False, assign=True)
        model.eval().requires_grad_(False)
        del state

        t = time.perf_counter()
        with _inductor_caches(job.tactics.path):
            plan, matmuls = decode_kernels.matmul_plan(model, shapes.batch_buckets, recipe.tactics_level,
                                                recipe.options.get("decode_matmul", "auto"), device, job)
        phases["select_matmuls_s"] = time.perf_counter() - t
        attention = decode_kernels.attention_plan(cfg, dtype, recipe.options.get("decode_attention", "auto"), device)

        graphs = _export_graphs(model, shapes, device, job.progress, plan, attention["used"] == "kernel")
        phases["export_s"] = sum(g.pop("export_s") for g in graphs.values())

        configs = {name: inductor_configs(recipe.tactics_level, device, name) for name in graphs}
        tuned: list[dict[str, Any]] = []
        t = time.perf_counter()
        with _inductor_caches(job.tactics.path), _record_autotuning(tuned):
            for name, graph in graphs.items():
                job.progress(f"compiling {name} with AOTInductor (tactics: {recipe.tactics_level})")
                g0 = time.perf_counter()
                graph["reused"] = _compile_or_reuse(graph, name, configs[name], job)
                graph["compile_s"] = time.perf_counter() - g0
                del graph["program"]
        phases["compile_s"] = time.perf_counter() - t
        reused = [name for name, g in graphs.items() if g["reused"]]

        engine = {
            "hf_config": raw,
            "dtype": recipe.precision,
            "device": device,
            "max_batch_size": shapes.max_batch_size,
            "max_input_len": shapes.max_input_len,
            "max_seq_len": shapes.max_seq_len,
            "buckets": list(shapes.batch_buckets),
            "tied_output": cfg.tie_word_embeddings,
            "graphs": {name: {k: v for k, v in g.items()} for name, g in graphs.items()},
        }
        (job.workdir / ENGINE_JSON).write_text(json.dumps(engine, indent=2, sort_keys=True) + "\n")
        tactics = {"level": recipe.tactics_level, "inductor_configs": configs,
                   "selections": tuned, "benchmarked": sum(s["num_candidates"] for s in tuned),
                   "decode_matmuls": matmuls, "decode_attention": attention,
                   "cache": str(job.tactics.path), "compiled_graphs_reused": reused}
        if recipe.tactics_level == "max" and not tuned:
            tactics["note"] = "no GEMM benchmarking ran: every choice came from the tactic cache"
        return BuildOutput(phases=phases, tactics=tactics, extra={"graphs": list(graphs)})

    def load(self, entry: Path, manifest: dict[str, Any]) -> Any:
        from trtbuild.backends.torch_runtime import TorchEngine

        return TorchEngine(entry)


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
    from trtbuild.backends import cxx

    base["cpp.cxx"] = (None, cxx.compiler().path)  # exactly the compiler the key records
    if level == "none":
        return base | {"max_autotune": False, "coordinate_descent_tuning": False, "triton.autotune_pointwise": False}
    if level == "default" or graph == "prefill":
        return base
    tuned = base | {"max_autotune": True, "coordinate_descent_tuning": False}
    return tuned if device.startswith("cuda") else tuned | {"max_autotune_gemm_backends": "ATEN"}


def _export_graphs(model: Any, shapes: Any, device: str, progress: Any,
                   plan: dict[int, dict[tuple[int, int], Any]] | None = None,
                   attention_kernel: bool = False) -> dict[str, dict[str, Any]]:
    graphs: dict[str, dict[str, Any]] = {}
    progress("exporting prefill")
    t = time.perf_counter()
    ep = export_prefill(model, shapes.max_batch_size, shapes.max_input_len, device)
    graphs["prefill"] = {"batch": "dynamic", "program": ep, "export_s": time.perf_counter() - t}
    for b in shapes.batch_buckets:
        progress(f"exporting decode for batch {b}")
        t = time.perf_counter()
        routed = (plan or {}).get(b, {})
        with decode_kernels.routed(model, routed, attention_kernel):
            ep = export_decode(model, b, shapes.max_seq_len, device)
        graphs[f"decode_b{b}"] = {"batch": b, "program": ep, "window": "dynamic",
                                  "matmuls": {f"{n}x{k}": c.name for (n, k), c in sorted(routed.items())},
                                  "attention": "kernel" if attention_kernel else "aten",
                                  "export_s": time.perf_counter() - t}
    return graphs


def export_prefill(model: Any, max_batch_size: int, max_input_len: int, device: str, example_len: int = 2) -> Any:
    """The prompt step: batch and prompt length dynamic. Example sizes of 2 avoid export's 0/1
    specialization (a dimension with max 1 stays static). Inductor tunes the graph's kernels at the
    example sizes; `example_len` lets benchmarks/probe.py compare other lengths."""
    import torch
    from torch.export import Dim

    from trtbuild.models.llama import Step

    batch = Dim("batch", min=1, max=max_batch_size) if max_batch_size > 1 else None
    seq = Dim("seq", min=1, max=max_input_len) if max_input_len > 1 else None
    ex_b, ex_t = min(2, max_batch_size), min(max(2, example_len), max_input_len)
    with torch.no_grad():
        return torch.export.export(Step(model, from_start=True),
                                   (torch.zeros(ex_b, ex_t, dtype=torch.long, device=device),
                                    torch.arange(ex_t, device=device)),
                                   dynamic_shapes=({0: batch, 1: seq}, {0: seq}),
                                   # guards export cannot prove become runtime asserts, not failures
                                   prefer_deferred_runtime_asserts_over_guards=True)


def export_decode(model: Any, batch: int, max_seq_len: int, device: str) -> Any:
    """The decode step at one batch size: static batch, and one dynamic dimension, the number of
    cache slots attended over (the runtime picks the smallest window that covers the position)."""
    import torch
    from torch.export import Dim

    from trtbuild.models.llama import Step

    window = {0: Dim("window", min=2, max=max_seq_len)} if max_seq_len > 2 else None
    with torch.no_grad():
        return torch.export.export(Step(model, from_start=False),
                                   (torch.zeros(batch, 1, dtype=torch.long, device=device),
                                    torch.ones(1, dtype=torch.long, device=device),
                                    torch.arange(max_seq_len, device=device)),
                                   dynamic_shapes=(None, None, window),
                                   prefer_deferred_runtime_asserts_over_guards=True)


def program_text(program: Any) -> str:
    """An exported program as text for the compiled-graph cache's key: its operations, shapes, dtypes,
    strides, literals and signature, without the source-location comments export adds to each node.
    Those name the file and line of the model code that made the node, so a trtbuild installed in another
    folder, or an edit that only moved lines, would otherwise miss a cache of identical graphs."""
    return "\n".join(line for line in str(program).splitlines() if line.strip() and not line.lstrip().startswith("#"))


def _compile_or_reuse(graph: dict[str, Any], name: str, configs: dict[str, Any], job: BuildJob) -> bool:
    """Compile one exported graph into `workdir/<name>/`, or copy the compiled folder that an
    earlier build left in the tactic cache for exactly this graph. True when reused.

    Weights are not inside the compiled graph (they are runtime constants, never folded), so the
    compiled code depends only on the exported program (operations, shapes, dtypes, literals such
    as rms_norm_eps), the Inductor options, and the toolchain and device the tactic cache is
    already keyed by. A rebuild, or another recipe of the same architecture with other weights,
    then skips Inductor entirely.
    """
    import hashlib

    import torch

    program = graph["program"]
    text = program_text(program)
    text += decode_kernels.sources_called(text)
    digest = hashlib.sha256((text + "\0" + json.dumps(configs, sort_keys=True, default=str)).encode()).hexdigest()
    cached = job.tactics.path / "graphs" / digest[:32]
    dest = job.workdir / name
    if (cached / "COMPLETE").is_file():
        shutil.copytree(cached, dest, ignore=shutil.ignore_patterns("COMPLETE"))
        so_name = (cached / "COMPLETE").read_text().strip()
        graph["so"] = f"{name}/{so_name}"
        return True
    package = job.workdir / f"{name}.pt2"
    # A copy: aoti_compile_and_package adds its own keys to the dict it is given, which would
    # change the digest of every later graph compiled with the same options.
    torch._inductor.aoti_compile_and_package(program, package_path=str(package), inductor_configs=dict(configs))
    graph["so"] = _extract_model(package, dest)
    # Publish into the tactic cache the way the store publishes engines: a private folder, then one
    # rename; a concurrent builder that lost the race just keeps its own copy.
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_name(f"{cached.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(dest, tmp)
    (tmp / "COMPLETE").write_text(graph["so"].split("/", 1)[1] + "\n")
    try:
        os.rename(tmp, cached)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return False


def _extract_model(package: Path, dest: Path) -> str:
    """Unpack the compiled model (the wrapper .so, its cubins and metadata) out of the .pt2 and
    drop the archive: the runtime loads the .so directly, never through the package's C++ zip
    reader, which segfaults on the H200 image (torch 2.11) for every package; and a restart then
    unpacks nothing. Generated C++ sources are not needed to run and are left out."""
    import zipfile

    dest.mkdir()
    so = None
    with zipfile.ZipFile(package) as archive:
        for info in archive.infolist():
            parts = info.filename.split("/")
            if len(parts) < 5 or parts[1:4] != ["data", "aotinductor", "model"] or info.is_dir():
                continue
            if info.filename.endswith(".cpp"):
                continue
            target = dest / "/".join(parts[4:])
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(info) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            if target.name.endswith(".wrapper.so") or (target.suffix == ".so" and so is None):
                so = target
    package.unlink()
    if so is None:
        raise TrtbuildError(f"{package}: AOTInductor wrote no compiled model (.so) into the package")
    return so.relative_to(dest.parent).as_posix()


@contextlib.contextmanager
def _inductor_caches(path: Path) -> Iterator[None]:
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
def _record_autotuning(out: list[dict[str, Any]]) -> Iterator[None]:
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
