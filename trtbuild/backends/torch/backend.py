"""The PyTorch AOTInductor backend: torch.export + AOTInductor, run on CPU or CUDA.

An entry holds one prefill graph (dynamic batch and prompt length, attention through SDPA's fused causal
kernels), one decode graph per batch bucket (static batch; dynamic in how many cache slots attention
reads; on the CPU the prefill and the buckets share one step program, `export.shared_step`), and the
weights as one safetensors file in the engine's own fused layout and dtype. Each graph is compiled by
`aoti_compile_and_package` without its weights inside (`package_constants_in_so=False`) and unpacked from
the .pt2 into a folder holding the compiled .so (and, on CUDA, its cubins). At load the weights and a KV
cache that trtbuild allocates are handed to every graph as user-managed constants, so prefill and decode
share one cache and the weights exist once on disk and once in device memory. Compiled graphs are kept
and found again by `graph_cache.py`; the graphs after the first compile side by side in
`compile_workers.py`; the model is placed on the device and exported by `export.py`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

from trtbuild.backends import BuildJob, BuildOutput
from trtbuild.backends.torch import compile_workers, decode_kernels, graph_cache, moe_plan, prefill_attention, quantized
from trtbuild.backends.torch.inductor import (DTYPE_NAMES, inductor_caches, inductor_configs, kernels_wait, prepare_cpu,
                                              record_autotuning)
from trtbuild.backends.torch import export
from trtbuild.backends.torch.export import bucket, export_graph, model_bytes, place_model
from trtbuild.store import fingerprint

WEIGHTS = "weights.safetensors"
ENGINE_JSON = "engine.json"
# Every recipe option this backend takes, with its modes (the first is the default).
OPTIONS = decode_kernels.OPTIONS | prefill_attention.OPTIONS | quantized.OPTIONS | moe_plan.OPTIONS | export.OPTIONS


def _option(recipe: Any, name: str) -> str:
    """A recipe option of this backend, or its default: the first of its modes (one place, so that the
    default a build uses is the one `check` accepts and the README names)."""
    return recipe.options.get(name, OPTIONS[name][0])


class TorchAOTIBackend:
    name = "torch"
    build_modules = ("trtbuild.backends.torch.export", "trtbuild.backends.torch.inductor",
                     "trtbuild.backends.torch.decode_kernels", "trtbuild.backends.torch.prefill_attention",
                     "trtbuild.backends.torch.graph_cache", "trtbuild.backends.torch.compile_workers",
                     "trtbuild.backends.torch.moe_plan",
                     "trtbuild.backends.torch.quantized", "trtbuild.backends.torch.tensor_parallel",
                     "trtbuild.parallel")

    def check(self, recipe: Any) -> list[str]:
        problems = [f"options.{k}: unknown option for backend torch (known: {', '.join(OPTIONS)})"
                    for k in recipe.options if k not in OPTIONS]
        for name, modes in OPTIONS.items():
            if _option(recipe, name) not in modes:
                problems.append(f"options.{name}: expected one of {', '.join(modes)}, got {recipe.options[name]!r}")
        if recipe.options.get("decode_matmul") == "kernel" and recipe.tactics_level == "none":
            problems.append("options.decode_matmul: 'kernel' picks its configuration by timing, which tactics "
                            "level none turns off; use level default, or decode_matmul auto/cublas")
        if recipe.model.kind == "onnx":
            problems.append("model.source: the torch backend takes a Hugging Face model, not ONNX")
        if recipe.parallel.tp > 1 and recipe.precision in quantized.QUANTIZED_PRECISIONS:
            problems.append(f"parallel.tp: precision {recipe.precision} is not split across ranks yet; "
                            "use fp32, fp16 or bf16 with tp > 1")
        return problems + quantized.check(recipe)

    def toolchain(self) -> dict[str, str]:
        import torch

        from trtbuild.backends.torch import cxx

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
        env = fingerprint.compile_environment()
        if env:
            # Settings read from the environment change what Inductor and Triton compile: the key must see
            # them, or builds with and without would share an engine (the H200 gave a build with
            # TRTBUILD_INDUCTOR_PDL=0 the key of one without, 2026-12-04).
            tools["env"] = " ".join(f"{k}={v}" for k, v in sorted(env.items()))
        return tools

    # -- build -----------------------------------------------------------------------------------
    def build(self, job: BuildJob) -> BuildOutput:
        import torch

        from trtbuild.backends.torch import weights_preload
        from trtbuild.models import compressed
        from trtbuild.models.checkpoint import convert_hf_state_dict
        from trtbuild.models.families import model_paths, windows_within

        weights_preload.discard()  # a run's guess of another entry: its device memory is the build's now
        recipe, shapes = job.recipe, job.recipe.shapes
        dtype = getattr(torch, DTYPE_NAMES[recipe.precision])
        device = "cuda" if job.device.get("kind") == "cuda" else "cpu"
        if recipe.parallel.tp > 1:  # one set of graphs with collectives, a shard of the weights a rank
            from trtbuild.backends.torch import tensor_parallel

            return tensor_parallel.build(job, dtype, device, save_weights)
        phases: dict[str, float] = {}

        t = time.perf_counter()
        quantizing = recipe.precision in quantized.QUANTIZED_PRECISIONS
        # a quantized engine is quantized from the checkpoint's own numbers (fp32 on the CPU; on a GPU, bf16)
        source_dtype = torch.float32 if quantizing and device == "cpu" else dtype
        folder, raw, cfg, hf = job.model.checkpoint(source_dtype)
        state = convert_hf_state_dict(hf, cfg)
        del hf
        # a compressed-tensors FP8 checkpoint: its Linears as stored for an fp8 engine, dequantized otherwise
        state = compressed.apply(folder, raw, cfg.num_layers, state, keep_fp8=recipe.precision == "fp8")
        phases["load_weights_s"] = time.perf_counter() - t - job.model.synthesized_s
        if job.model.synthesized_s:
            phases["draw_synthetic_weights_s"] = job.model.synthesized_s
        quant: dict[str, Any] | None = None
        if quantizing:
            job.progress(f"quantizing the weights to {recipe.precision}")
            # the sequences the model writes for its calibration, kept beside the tactics for its next build
            # (another precision, other shapes): a folder for each checkpoint
            generated = job.tactics.path / "calibration" / job.model.digest[:16]
            state, quant = quantized.quantize_weights(state, cfg, recipe, job.model.tokenizer, device, job.progress,
                                                      generated)
            phases["quantize_s"] = quant["seconds"]

        model = place_model(cfg, shapes, dtype, device, state)
        t = time.perf_counter()
        # a tied LM head is the embedding table, stored once; a quantized head (options.lm_head) has its own
        tied = cfg.tie_word_embeddings and "output.weight" in state
        stored = {k: v.contiguous() for k, v in state.items() if not (tied and k == "output.weight")}
        save_weights(stored, job.workdir / WEIGHTS)
        job.finished(job.workdir / WEIGHTS)
        phases["write_weights_s"] = time.perf_counter() - t
        del state, stored

        t = time.perf_counter()
        selection: dict[str, float] = {}
        with inductor_caches(job.tactics.path):
            plan, matmuls = decode_kernels.matmul_plan(model, shapes.batch_buckets, recipe.tactics_level,
                                                       _option(recipe, "decode_matmul"), device, job,
                                                       _option(recipe, "decode_fusion"),
                                                       _option(recipe, "decode_split_k"), selection)
        phases["select_matmuls_s"] = time.perf_counter() - t
        # of which: the candidates compiled ahead, and the timings (each fused call site's unfused reference
        # compiled by torch.compile among them): a cold GPU build's largest phase, to be taken apart
        phases.update({f"select_matmuls_{k}": v for k, v in selection.items()})
        attention = decode_kernels.attention_plan(windows_within(cfg, shapes.max_seq_len), dtype,
                                                  _option(recipe, "decode_attention"), device)
        # a mixture of experts' decode path, timed on the model's own experts where asked (moe_plan.py)
        moe = moe_plan.plan(model, _option(recipe, "moe_decode"), device, max(shapes.batch_buckets))
        moe_plan.route(model, moe["used"])
        moe_prompt = moe_plan.prefill_plan(model, _option(recipe, "moe_prefill"), dtype, device)
        moe_plan.route_prefill(model, moe_prompt["used"])
        t = time.perf_counter()
        prompt = prefill_attention.plan(cfg, dtype, _option(recipe, "prefill_attention"), device,
                                        shapes.max_input_len, job)
        phases["select_prefill_attention_s"] = time.perf_counter() - t

        paged = [export.PAGED, export.PAGED_MIXED] if _option(recipe, "kv_cache") == "paged" else []
        step = export.shared_step(device, shapes)
        names = ["prefill", *(f"decode_b{b}" for b in shapes.batch_buckets), *paged]
        configs = {name: inductor_configs(recipe.tactics_level, device, name) for name in names}
        # Each graph is one program, or with regional compilation one program a region (models/regions.py): the
        # units exported and compiled below, each named "<graph>" or "<graph>.r<k>".
        regions = export.regions(model, _option(recipe, "compile"))
        units: dict[str, tuple[str, int | None, list[int] | None]] = {}
        for name in names:
            if regions and export.regional(name, _option(recipe, "compile")):
                units |= {f"{name}.r{k}": (name, layers[0], layers) for k, layers in enumerate(regions)}
            else:
                units[name] = (name, None, None)
        # Everything an export reads but the weights' values: a graph an earlier build exported from the same
        # material (another checkpoint of this architecture, or this one after `cache rm`) is copied from the
        # tactic cache without exporting again.
        material = {"config": dataclasses.asdict(cfg), "shapes": [shapes.max_batch_size, shapes.max_input_len,
                                                                   shapes.max_seq_len], "device": device,
                    "tensors": {k: [list(v.shape), str(v.dtype)] for k, v in model.state_dict().items()},
                    "plan": {str(b): {decode_kernels.key_name(k): c.name for k, c in sorted(p.items())}
                             for b, p in plan.items()},
                    "attention": attention["used"], "prefill_attention": prompt["used"],
                    "moe_decode": moe["used"], "moe_prefill": moe_prompt["used"], "step": list(step),
                    "regions": regions}
        graphs: dict[str, dict[str, Any]] = {}  # by unit
        records: dict[str, tuple[str, dict[str, Any]]] = {}  # unit -> (architecture key, export record)
        for unit, (name, layer, _) in units.items():
            architecture = graph_cache.architecture_key(unit, configs[name], material)
            known = graph_cache.known_export(job.tactics.path, architecture)
            # the one step program (a region of it) that the prefill and the decode buckets share, exported
            # already; the paged graphs are programs of their own
            shared = next((g for u, g in graphs.items() if step[1] and units[u][0] not in paged
                           and units[u][1] == layer and "program" in g), None)
            if known is None and shared is not None and name not in paged:
                graphs[unit] = shared | {"export_s": 0.0}
            elif known is None:
                job.progress(f"exporting {unit}")
                graphs[unit] = export_graph(model, name, shapes, device, plan.get(bucket(name), {}),
                                            attention["used"], prompt["used"], step, layer)
                graphs[unit]["digest"] = graph_cache.graph_digest(graphs[unit]["program"], configs[name])
            else:
                graphs[unit] = known | {"export_s": 0.0}
            records[unit] = (architecture, graph_cache.export_record(graphs[unit]))
        phases["export_s"] = sum(g.pop("export_s") for g in graphs.values())
        graph_cache.sweep_half_copied(job.tactics.path)
        missing: list[str] = []  # one unit a digest: graphs sharing one program compile it once, then copy it
        for unit, graph in graphs.items():
            if not graph_cache.cached(job.tactics.path, graph["digest"]).is_file() and \
                    all(graphs[n]["digest"] != graph["digest"] for n in missing):
                missing.append(unit)
        workers_n = compile_workers.worker_count(len(missing), model_bytes(model), device)
        slots = workers_n + 1
        dealt = {unit: i % slots for i, unit in enumerate(missing)}  # 0: the build's own
        tuned: list[dict[str, Any]] = []
        t = time.perf_counter()
        spare = job.workdir / ".workers"  # removed before the entry is published
        common = {"folder": str(folder), "precision": recipe.precision, "device": device,
                  "max_batch_size": shapes.max_batch_size, "max_input_len": shapes.max_input_len,
                  "max_seq_len": shapes.max_seq_len, "level": recipe.tactics_level, "tactics": str(job.tactics.path),
                  "attention": attention["used"], "prefill_attention": prompt["used"],
                  "moe_decode": moe["used"], "moe_prefill": moe_prompt["used"], "step": list(step),
                  "lm_head": _option(recipe, "lm_head")}
        forking = compile_workers.forks_for(device)
        if forking and missing:
            prepare_cpu(configs[units[missing[0]][0]])
        with inductor_caches(job.tactics.path), record_autotuning(tuned), \
                (compile_workers.Forks(spare) if forking else
                 compile_workers.Workers(spare, max(1, (os.cpu_count() or 1) // (workers_n + 1)))) as workers, \
                (compile_workers.timing_alone(job.tactics.path / compile_workers.TIMING_LOCK) if workers_n
                 and not forking else contextlib.nullcontext()):
            # The missing units dealt out in turn to the build and its workers; each compiles its share in order.
            for j in range(1, slots):
                share = [u for u in missing if dealt[u] == j]
                if forking:
                    workers.start(share, functools.partial(_compile_forked, [(graphs[u], u, configs[units[u][0]],
                                                                             spare / u) for u in share],
                                                           job.tactics.path, tuned))
                    continue
                workers.start(common | {"units": [{"graph": units[u][0], "unit": u, "layer": units[u][1],
                                                   "digest": graphs[u]["digest"], "workdir": str(spare / u),
                                                   "matmuls": graphs[u].get("matmuls", {})} for u in share]})
            # the build's own share first, then every other unit: the workers' ones from the cache they fill
            for unit in [u for u in missing if dealt[u] == 0] + [u for u in graphs if dealt.get(u, 1)]:
                graph, name = graphs[unit], units[unit][0]
                where = " (in a worker process)" if unit in workers.running else ""
                job.progress(f"compiling {unit} with AOTInductor (tactics: {recipe.tactics_level}){where}")
                g0 = time.perf_counter()
                report = workers.wait(unit)
                graph["reused"] = graph_cache.compile_or_reuse(graph, unit, configs[name], graph["digest"],
                                                               job.tactics.path, job.workdir)
                if report is not None:  # found in the cache because this build's worker put it there
                    graph["reused"] = False
                    graph["worker"] = {k: v for k, v in report.items() if k != "tuned"}
                    tuned.extend(report.get("tuned", []))
                    if forking and report["ok"]:  # the same process's work, only forked: counted as the build's
                        graph.update({k: report[k] for k in graph_cache.COMPILE_PARTS if k in report})
                graph["compile_s"] = time.perf_counter() - g0
                graph.pop("program", None)
                graph_cache.remember_export(job.tactics.path, *records[unit])
        shutil.rmtree(spare, ignore_errors=True)
        phases["compile_s"] = time.perf_counter() - t
        # of which, for the graphs compiled in this process or its forks: Inductor's Python, and the C++ compiler's
        # (with forks, their sum can exceed compile_s: the graphs compiled side by side)
        for part in ("inductor_s", "cxx_s"):
            phases[f"compile_{part}"] = sum(g.get(f"compile_{part}", 0.0) for g in graphs.values())
        graphs = _assembled(graphs, units, names, model.embed_scale)
        for name, graph in graphs.items():
            graph["pdl"] = bool(configs[name].get("triton.enable_pdl"))
            graph["trtbuild_wait"] = name.startswith("decode_b") and kernels_wait(device)
            if (timed := decode_kernels.timed_step_us(matmuls, bucket(name))) is not None:
                graph["matmuls_timed_us"] = timed  # for the run report: where a step's time goes
                graph["fused_outside"] = decode_kernels.fused_outside(matmuls, bucket(name))
        reused = [name for name, g in graphs.items() if g["reused"]]

        engine = {
            "hf_config": raw,
            "dtype": recipe.precision,
            "device": device,
            "max_batch_size": shapes.max_batch_size,
            "max_input_len": shapes.max_input_len,
            "max_seq_len": shapes.max_seq_len,
            "buckets": list(shapes.batch_buckets),
            "tied_output": tied,
            "quantization": quant,
            "graphs": {name: {k: v for k, v in g.items()} for name, g in graphs.items()},
        }
        (job.workdir / ENGINE_JSON).write_text(json.dumps(engine, indent=2, sort_keys=True) + "\n")
        tactics = {"level": recipe.tactics_level, "inductor_configs": configs,
                   "selections": tuned, "benchmarked": sum(s["num_candidates"] for s in tuned),
                   "decode_matmuls": matmuls, "decode_attention": attention, "prefill_attention": prompt,
                   "cache": str(job.tactics.path), "compiled_graphs_reused": reused,
                   "model_paths": model_paths(windows_within(cfg, shapes.max_seq_len)), "moe_decode": moe,
                   "moe_prefill": moe_prompt,
                   "compile_workers": workers_n}
        if recipe.tactics_level == "max" and not tuned:
            tactics["note"] = "no GEMM benchmarking ran: every choice came from the tactic cache"
        return BuildOutput(phases=phases, tactics=tactics, extra={"graphs": list(graphs)})

    def load(self, entry: Path, manifest: dict[str, Any]) -> Any:
        from trtbuild.backends.torch.runtime import TorchEngine

        if (entry / "rank0").is_dir():  # a tensor-parallel entry (tensor_parallel.py): one process a rank
            from trtbuild.backends.torch.tp_runtime import TensorParallelEngine

            return TensorParallelEngine(entry)
        return TorchEngine(entry)

    def preload(self, entry: Path, manifest: dict[str, Any]) -> list[Path]:
        """Start reading a cached engine's weights onto its GPU before torch is imported (weights_preload:
        runtime code, kept out of this module, whose source keys every engine); the files it reads."""
        from trtbuild.backends.torch import weights_preload

        return weights_preload.start_for(entry)


def _assembled(units: dict[str, dict[str, Any]], where: dict[str, tuple[str, int | None, list[int] | None]],
               names: list[str], embed_scale: float) -> dict[str, dict[str, Any]]:
    """The engine spec's graphs from the compiled units: a whole graph as it is; a regional one as its first
    unit's description with "regions", each region's compiled .so and the layers it runs, the embeddings'
    scale (the runtime gathers them), and the units' compile seconds summed ("reused" only where every region
    was)."""
    graphs: dict[str, dict[str, Any]] = {}
    for name in names:
        parts = [(units[u], where[u][2]) for u in units if where[u][0] == name]
        if len(parts) == 1 and parts[0][1] is None:
            graphs[name] = parts[0][0]
            continue
        kept = ("so", "digest", "reused", "compile_s", *graph_cache.COMPILE_PARTS, "worker")
        graphs[name] = {k: v for k, v in parts[0][0].items() if k not in kept} | {
            "regions": [{"layers": layers, **{k: g[k] for k in kept if k in g}} for g, layers in parts],
            "embed_scale": embed_scale,
            "reused": all(g["reused"] for g, _ in parts),
            "compile_s": sum(g["compile_s"] for g, _ in parts),
            "digest": hashlib.sha256("".join(g["digest"] for g, _ in parts).encode()).hexdigest()}
        for part in ("compile_inductor_s", "compile_cxx_s"):
            if any(part in g for g, _ in parts):
                graphs[name][part] = sum(g.get(part, 0.0) for g, _ in parts)
    return graphs


def _compile_forked(work: list[tuple[dict[str, Any], str, dict[str, Any], Path]], tactics: Path,
                    tuned: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A forked child's work (compile_workers.Forks): compile its units (graph, unit name, Inductor options,
    folder) in turn into the tactic cache, where the build finds them; each one's seconds and its GEMM
    selections (`tuned`, the child's copy of the build's list) for the report, by unit."""
    reports: dict[str, dict[str, Any]] = {}
    for graph, unit, configs, workdir in work:
        del tuned[:]  # the selections made before (the build's, or this child's last unit's) are not this one's
        t = time.perf_counter()
        graph_cache.compile_or_reuse(graph, unit, configs, graph["digest"], tactics, workdir)
        reports[unit] = {"compile_s": time.perf_counter() - t, "tuned": list(tuned),
                         **{k: graph[k] for k in graph_cache.COMPILE_PARTS if k in graph}}
    return reports


def save_weights(tensors: dict[str, Any], path: Path) -> None:
    """safetensors' save_file, with its I/O failures raised as the OSError they are: it reports them as
    SafetensorError("... (os error 28)"), which the builder would not recognize as a full disk (an 8B
    build on the H200 hit one: RESULTS.md, 2026-12-04) and the CLI would show as a crash."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path))
    except Exception as exc:
        found = re.search(r"\(os error (\d+)\)", str(exc))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from exc
