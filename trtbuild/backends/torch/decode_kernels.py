"""Which of trtbuild's own decode kernels a torch build compiles into its decode graphs.

The kernels live with the model code (`trtbuild/kernels/decode_matmul.py`, `decode_attention.py`: their
sources are part of the engine key); this module is the backend's side of them: the recipe options that
choose them, the build-time plan (timed per weight shape for the matmuls, by what the attention kernel
can serve), the switch that routes the model through them for one export, and their sources' part in
the compiled-graph cache's key.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trtbuild.backends import BuildJob
from trtbuild.errors import TrtbuildError

# options.decode_matmul: auto = trtbuild's decode kernel where it measures faster than cuBLAS (per weight
# shape and batch bucket); cublas = never; kernel = always (its fastest configuration), for A/B runs.
DECODE_MATMUL_MODES = ("auto", "cublas", "kernel")
# options.decode_attention: auto = trtbuild's decode attention kernel where it can serve the model (a CUDA
# build of a 16-bit model, head_dim a power of two), with the rotation of the query and new key and the
# cache writes in the same launch; aten = the masked attention Inductor compiles from the model code;
# kernel = the kernel, or a recipe error where it cannot serve. (A mode for the attention alone, rope and the
# cache writes compiled by Inductor, measured no gain and was removed: RESULTS.md.) (A one-launch mode, the last program of each
# sequence and KV head merging the partials, measured slower on the H200 and was removed: RESULTS.md.) (A mode whose
# launches read the position, the rope row and their first cached tile before the PDL wait measured level with the
# default on the H100, 1B bf16, and was removed: RESULTS.md, "Tried, not kept".)
DECODE_ATTENTION_MODES = ("auto", "aten", "kernel")
# options.decode_fusion: epilogue (the default) = a decode matmul through the
# kernel also does what comes after it at its call site: the SiLU gating of gate/up and the residual adds
# (one launch instead of two), never the norm before it (the H200 measured the fused norm
# doubling the kernel's time on its 2-16-row path). On the H200 it took 157 / 104 us off the 8B step at
# batch 1 / 8 (run drift 2-6 us) and 21 us off the 1B step at batch 8 (+3 us at batch 1): RESULTS.md,
# RESULTS.md. Each fused call site is timed against cuBLAS plus Inductor's ops and
# against the kernel alone plus those ops, so it is used only where it measured faster.
# none = the kernel does the matmul alone and Inductor compiles the norms, gating and adds around it.
# (A mode with the norms in the kernel too, their gains folded into the weights, took kernels off the 8B step
# and no time on the H200, and was removed: RESULTS.md.) The first mode of each option is its default.
DECODE_FUSION_MODES = ("epilogue", "none")
# a call site's fusion under `epilogue`: its norm stays outside the kernel
EPILOGUE = {"none": "none", "norm": "none", "residual": "residual", "norm_gate": "gate"}
# options.decode_split_k: none (the default) = each program of the decode matmul streams whole weight rows;
# timed = split-K configurations (each block of columns shared by 2 or 4 programs, each a slice of k, and a
# small kernel adding their fp32 partial sums) are timed with the others, for the plain matmul. Opt-in:
# on the H200, −22 µs a 1B step at batch 1, none kept at 8B (RESULTS.md).
DECODE_SPLIT_K_MODES = ("none", "timed")
# The selection times each candidate in a CUDA graph with full edges, each launch after the previous one
# completes. (Timing with the programmatic edges the decode graphs run with on Hopper measured no gain in the
# engine and was removed: RESULTS.md.)
OPTIONS = {"decode_matmul": DECODE_MATMUL_MODES, "decode_attention": DECODE_ATTENTION_MODES,
           "decode_fusion": DECODE_FUSION_MODES, "decode_split_k": DECODE_SPLIT_K_MODES}

MatmulKey = tuple[int, int, str]  # (out, in, fusion) of one routed Linear; (out, in, `quant_site`) of a quantized one
# the stored formats of quantized Linears (models/quantize.py), which take a plan key's fusion place: their kernel
# (kernels/quant_matmul.py) has its own timings per format, and does a call site's epilogue (the gating, the
# residual add) as the dense kernel does under options.decode_fusion epilogue, never its norm
QUANT_FORMATS = ("fp8", "int8", "int4")


def quant_site(fmt: str, epilogue: str) -> str:
    """A quantized Linear's plan key's last part: its format, and "+<epilogue>" where the kernel also does it."""
    return fmt if epilogue == "none" else f"{fmt}+{epilogue}"


def site_fusion(site: str) -> str:
    """What the kernel does besides the matmul at a plan key's last part: a dense key's fusion, a quantized
    key's epilogue."""
    fmt, _, epilogue = site.partition("+")
    return (epilogue or "none") if fmt in QUANT_FORMATS else site


def key_name(key: MatmulKey) -> str:
    """'<out>x<in>', with '+<fusion>' when the kernel does more than the matmul: the plan as recorded."""
    n, k, fusion = key
    return f"{n}x{k}" if fusion == "none" else f"{n}x{k}+{fusion}"


def parse_key(name: str) -> MatmulKey:
    shape, _, fusion = name.partition("+")
    n, k = shape.split("x")
    return int(n), int(k), fusion or "none"

# The custom op each kernel module registers, as it appears in an exported program's text.
KERNEL_MODULES = {"trtbuild.decode_matmul": "trtbuild.kernels.decode_matmul",
                  "trtbuild.decode_attention": "trtbuild.kernels.decode_attention",
                  "trtbuild.quant_matmul": "trtbuild.kernels.quant_matmul",
                  "trtbuild.moe_gathered": "trtbuild.kernels.moe_gather",
                  "trtbuild.paged_attention": "trtbuild.kernels.paged_attention"}


def matmul_plan(model: Any, buckets: tuple[int, ...], level: str, mode: str, device: str, job: BuildJob,
                fusion_mode: str = DECODE_FUSION_MODES[0],
                split_mode: str = DECODE_SPLIT_K_MODES[0],
                seconds: dict[str, float] | None = None) -> tuple[dict[int, dict[MatmulKey, Any]], dict[str, Any]]:
    """Which decode matmuls go through trtbuild's Triton kernel, measured per batch bucket and weight shape.

    For every weight shape of the model (QKV, output, gate/up, down, LM head) `decode_matmul.select`
    times cuBLAS and each candidate configuration over the model's own weights of that shape, in a
    CUDA graph, with the fusion the kernel would do there (`fusion_mode`, options.decode_fusion); the
    kernel is used only where it measured faster. Each measurement is kept in the tactic cache under
    the shape, fusion, batch, dtype, layer count, candidate list and kernel source, so a rebuild (or
    another recipe of the same shapes) measures nothing. Returns the plan per bucket ({(out, in,
    fusion): MatmulConfig}) and what to record in the manifest. `mode` is options.decode_matmul;
    `split_mode` options.decode_split_k (timed: split-K configurations among the candidates).
    A quantized engine's quantized Linears are timed the same way per (out, in, format) and batch, among the
    quantized kernel's candidates only (it has no cuBLAS rival: ATen would dequantize every weight every step),
    each with its call site's epilogue under `epilogue` (the gating, the residual add: one launch fewer; with
    split-K the reduction does it); their plan keys carry the format and epilogue where the others carry a
    fusion (`quant_site`). `seconds`, where given, gets where the selection's time went: "ahead_s" (the candidates compiled ahead), "timing_s" (the rest) and
    of that, for the dense kernel's fresh selections, "timing_references_s" (cuBLAS and the unfused rivals,
    their torch.compile included) and "timing_candidates_s".
    """
    if mode == "kernel" and not device.startswith("cuda"):
        raise TrtbuildError("options.decode_matmul: 'kernel' is a CUDA kernel, and this build is for the CPU")
    if mode == "cublas" or level == "none" or not device.startswith("cuda"):
        why = ("options.decode_matmul is cublas" if mode == "cublas" else
               "tactics level none" if level == "none" else "a CPU build")
        return {}, {"note": f"cuBLAS (ATen) for every matmul: {why}"}
    try:
        from trtbuild.kernels import decode_matmul as dm
    except ImportError as e:  # torch's CUDA wheels bring Triton; a source build may not
        if mode == "kernel":
            raise TrtbuildError(f"options.decode_matmul: 'kernel' needs Triton, which does not import here ({e})") from e
        return {}, {"note": f"cuBLAS for every matmul: the decode kernel needs Triton ({e})"}
    from trtbuild.models.llama import Linear

    by_shape: dict[MatmulKey, list[Any]] = {}
    quantized: dict[MatmulKey, list[Any]] = {}  # (out, in, quant_site): each layer's (qweight, scale, zero)
    for mod in model.modules():
        if isinstance(mod, Linear) and mod.quant is not None:
            site = quant_site(mod.quant, fusion_of(mod, fusion_mode))
            quantized.setdefault((mod.out_features, mod.in_features, site), []).append(
                (mod.qweight, mod.scale, getattr(mod, "zero", None)))
        elif isinstance(mod, Linear):
            same = by_shape.setdefault((mod.out_features, mod.in_features, fusion_of(mod, fusion_mode)), [])
            if all(w is not mod.weight for w in same):  # a tied LM head is the embedding, counted once
                same.append(mod.weight)
    plan: dict[int, dict[MatmulKey, Any]] = {}
    record: dict[str, Any] = {}
    split = split_mode == "timed"
    full = level == "max"  # `default` times the likely configurations only (matmul_configs.LIKELY)
    spent: dict[str, float] = {}  # the fresh dense selections' seconds, by part (decode_matmul.select)
    ahead = _compile_ahead(dm, job, by_shape, buckets, mode, split, device, quantized, full)
    t = time.perf_counter()
    for rows in buckets:
        if rows > dm.MAX_ROWS:
            if mode == "kernel":
                raise TrtbuildError(f"options.decode_matmul: 'kernel' takes batch buckets of at most {dm.MAX_ROWS} "
                                    f"rows; shapes.batch_buckets has {rows}")
            record[f"decode_b{rows}"] = {"note": f"cuBLAS: the kernel takes at most {dm.MAX_ROWS} rows"}
            continue
        for (n, k, fusion), weights in by_shape.items():
            result = _timings(dm, job, weights, rows, (n, k, fusion), split, full, spent)
            # a fused call site may still be best served by the kernel alone, with Inductor's ops around it
            plain = (_timings(dm, job, weights, rows, (n, k, "none"), split, full, spent)
                     if fusion != "none" and mode == "auto" else None)
            choice, does, us = pick(result, plain, mode)
            if choice is None:
                raise TrtbuildError(f"options.decode_matmul: 'kernel', but no configuration of the kernel ran "
                                    f"correctly for batch {rows} and a {n}x{k} weight: {result['candidates']}")
            # calls: this call site's matmuls a step; chosen_us: one call the way chosen, as timed
            record.setdefault(f"decode_b{rows}", {})[key_name((n, k, fusion))] = result | {
                "used": choice, "fused": does != "none", "kernel_does": does, "calls": len(weights), "chosen_us": us}
            if choice != "cublas":
                plan.setdefault(rows, {})[(n, k, does)] = dm.MatmulConfig.parse(choice)
        for key, layers in quantized.items():
            config, entry = quant_choice(job, layers, rows, key)
            record.setdefault(f"decode_b{rows}", {})[key_name(key)] = entry
            if config is not None:
                plan.setdefault(rows, {})[key] = config
    if seconds is not None:  # the timings after the compile ahead, and of them the dense kernel's fresh selections'
        # references (cuBLAS, and each fused site's unfused rival through torch.compile) and candidates
        seconds.update({"ahead_s": float(ahead.get("seconds", 0.0)), "timing_s": time.perf_counter() - t,
                        **{f"timing_{k}": v for k, v in spent.items()}})
    return plan, record


def quant_choice(job: BuildJob, layers: list[Any], rows: int, key: MatmulKey) -> tuple[Any, dict[str, Any]]:
    """The quantized decode matmul's configuration for one (out, in, format) at `rows` rows, timed over `layers`
    (each layer's (qweight, scale, zero)) through the tactic cache, and what to record of it. None where no
    candidate ran correctly: the decode graphs then take the format's fixed configuration
    (`export.quantized_decode`), as a build that times nothing does."""
    from trtbuild.kernels import quant_matmul as qm

    result = _quant_timings(qm, job, layers, rows, key)
    choice = result["choice"]
    fmt, epilogue = key[2].partition("+")[0], site_fusion(key[2])
    entry = result | {"used": choice or f"{qm.CONFIGS[fmt].name} (fixed: no candidate ran, no epilogue)",
                      "fused": choice is not None and epilogue != "none",
                      "kernel_does": epilogue if choice is not None else "none", "calls": len(layers)}
    if choice is None:
        return None, entry
    return qm.MatmulConfig.parse(choice), entry | {"chosen_us": result["candidates"][choice]}


def fastest(result: dict[str, Any]) -> str | None:
    """The fastest configuration that ran correctly in a `decode_matmul.select` result, whether or not it
    beat cuBLAS."""
    timed = {name: us for name, us in result["candidates"].items() if isinstance(us, float)}
    return min(timed, key=timed.__getitem__) if timed else None


def pick(result: dict[str, Any], plain: dict[str, Any] | None, mode: str) -> tuple[str | None, str, float | None]:
    """(configuration or "cublas", the fusion the kernel does: the call site's or "none", µs a call the way
    chosen, as timed) for one call site, from its `select` result and, for a fused call site, the result of
    the same shape without the fusion (`plain`).

    The ways to run a fused call site: cuBLAS with Inductor's ops around it (`unfused_us`), the fused
    kernel, and the kernel alone with Inductor's ops around it (its time + unfused_us - cublas_us). The
    third is there because on the H200 a fused kernel could take longer than the plain kernel, which still
    beat cuBLAS (RESULTS.md). `kernel` mode takes the fastest fused configuration (None if none ran)."""
    fusion = result.get("fusion", "none")
    if mode == "kernel":
        chosen = fastest(result)
        return (chosen, fusion, result["candidates"][chosen]) if chosen is not None else (None, "none", None)
    choice = result["choice"]
    unfused = result.get("unfused_us")
    if not isinstance(unfused, float):
        return ((choice, fusion, result["candidates"][choice]) if choice != "cublas" else
                ("cublas", "none", result["cublas_us"]))
    ways = [(unfused if choice == "cublas" else result["candidates"][choice], choice,
             fusion if choice != "cublas" else "none")]
    # Inductor's share of a way (its ops around the matmul) is a difference of two timings, each with a few
    # µs of noise; it is never taken below nothing. On the H200 (2026-12-05) cuBLAS + the gating
    # timed 3.5 µs *faster* than cuBLAS alone, so the plain kernel + "−3.5 µs" of gating beat the fused
    # kernel on paper and the build added a kernel to every layer: +180 µs an 8B step at batch 1.
    if plain is not None and (alone := fastest(plain)) is not None:
        ways.append((plain["candidates"][alone] + max(unfused - result["cublas_us"], 0.0), alone, "none"))
    us, chosen, does = min(ways, key=lambda way: way[0])  # the first of equals: the selection's own choice
    return chosen, does, us


def timed_step_us(record: dict[str, Any], rows: int) -> float | None:
    """µs of one decode step's matmuls at batch `rows`, from the selection's timings of the ways chosen
    (`matmul_plan`'s record): each shape timed over its own weights in a CUDA graph, without what runs
    between the matmuls in a step. None where the plan timed nothing for that batch."""
    sites = [r for r in record.get(f"decode_b{rows}", {}).values() if isinstance(r, dict) and "chosen_us" in r]
    return sum(r["chosen_us"] * r["calls"] for r in sites) if sites else None


def fused_outside(record: dict[str, Any], rows: int) -> list[str]:
    """The call sites at batch `rows` whose fusion (a norm, the gating, a residual add) the kernel does not do
    in the plan (`matmul_plan`'s record): cuBLAS there, or the kernel with less. Each is an Inductor kernel
    more in every layer, which is what a plan's choice between timings a few µs apart can cost: on the H200
    one such site put 32 kernels into the 8B step and took it from 1.19x to 1.25x its floor (2026-12-05)."""
    sites = {name: r for name, r in record.get(f"decode_b{rows}", {}).items() if isinstance(r, dict) and "used" in r}
    return sorted(name for name, r in sites.items()
                  if site_fusion(parse_key(name)[2]) not in ("none", r.get("kernel_does", "none")))


def _timings(dm: Any, job: BuildJob, weights: list[Any], rows: int, key: MatmulKey,
             split: bool = False, full: bool = True, spent: dict[str, float] | None = None) -> dict[str, Any]:
    """`decode_matmul.select` for one weight shape and fusion, kept in the tactic cache under the shape,
    fusion, batch, dtype, layer count, candidate list and kernel source, so a rebuild (or another recipe of
    the same shapes) measures nothing. `dm` is the decode_matmul module (it needs Triton). A fresh selection's
    seconds, by part, are added into `spent`."""
    from trtbuild.store.tactics import write_atomic

    cached, configs = _timing_file(dm, job, weights, rows, key, split, full)
    fusion = key[2]
    if cached.is_file():
        result: dict[str, Any] = json.loads(cached.read_text()) | {"reused": True}
        return result
    job.progress(f"timing decode matmuls for batch {rows}, {key_name(key)} ({len(weights)} matrices): "
                 f"cuBLAS and {len(configs)} kernel configurations")
    result = dm.select(weights, rows, fusion, split=split, configs=configs)
    if spent is not None:  # where a fresh selection's seconds went
        for part, value in result.get("seconds", {}).items():
            spent[part] = spent.get(part, 0.0) + float(value)
    write_atomic(cached, json.dumps(result, indent=1, sort_keys=True).encode())
    return result


def _timing_file(dm: Any, job: BuildJob, weights: list[Any], rows: int, key: MatmulKey,
                 split: bool, full: bool = True) -> tuple[Path, list[Any]]:
    """Where `_timings` keeps the timing of one shape, fusion and batch, and the candidates it times (the
    list's names are in the file's key, so a timing of the short list is not taken for one of the full)."""
    n, k, fusion = key
    configs = dm.candidates(rows, fusion, split, k, n, full)
    identity = {"n": n, "k": k, "rows": rows, "dtype": str(weights[0].dtype), "weights": len(weights),
                "fusion": fusion, "kernel": dm.source_digest(), "candidates": [c.name for c in configs]}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return job.tactics.path / "decode_matmul" / f"{digest}.json", configs


def _quant_timing_file(qm: Any, job: BuildJob, layers: list[Any], rows: int, key: MatmulKey) -> tuple[Path, list[Any]]:
    """Where `_quant_timings` keeps the timing of one quantized shape, format, epilogue and batch, and its
    candidates."""
    n, k, site = key
    q0, s0, z0 = layers[0]
    configs = qm.candidates_for(q0, s0, z0, rows, site_fusion(site))
    identity = {"n": n, "k": k, "rows": rows, "format": site, "scales": list(s0.shape), "weights": len(layers),
                "kernel": qm.source_digest(), "candidates": [c.name for c in configs]}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return job.tactics.path / "quant_matmul" / f"{digest}.json", configs


def _compile_ahead(dm: Any, job: BuildJob, by_shape: dict[MatmulKey, list[Any]], buckets: tuple[int, ...],
                   mode: str, split: bool, device: str,
                   quantized: dict[MatmulKey, list[Any]], full: bool = True) -> dict[str, Any]:
    """Compile, in parallel worker processes, the candidates that `matmul_plan` is about to time and has no
    timing of yet (kernel_warmup.py): its timings then load the kernels instead of compiling each in turn.
    Returns what was done (kernels, workers, seconds), for the build's phases."""
    from trtbuild.backends.torch import kernel_warmup

    work: list[kernel_warmup.Work] = []
    if quantized:
        from trtbuild.kernels import quant_matmul as qm

        for rows in (b for b in buckets if b <= qm.MAX_ROWS):
            for key, layers in quantized.items():
                path, configs = _quant_timing_file(qm, job, layers, rows, key)
                if not path.is_file():
                    work.append((rows, key[0], key[1], key[2], kernel_warmup.layout(layers[0]),
                                 tuple(c.name for c in configs)))
    for rows in (b for b in buckets if b <= dm.MAX_ROWS):
        for (n, k, fusion), weights in by_shape.items():
            timed = [fusion]  # the same fusions `matmul_plan` times: the site's own, and plain
            if fusion != "none" and mode == "auto":
                timed.append("none")
            for f in timed:
                path, configs = _timing_file(dm, job, weights, rows, (n, k, f), split, full)
                if not path.is_file():
                    work.append((rows, n, k, f, str(weights[0].dtype), tuple(c.name for c in configs)))
    if not work:
        return {"kernels": 0, "workers": 0, "seconds": 0.0}
    done = kernel_warmup.precompile(work, device, job.progress)
    if done.get("workers"):
        job.progress(f"compiled {done['kernels']} candidates ahead in {done['workers']} processes "
                     f"({done.get('seconds', 0)} s, {done.get('failed', 0)} did not compile)")
    return done


def _quant_timings(qm: Any, job: BuildJob, layers: list[Any], rows: int, key: MatmulKey) -> dict[str, Any]:
    """`quant_matmul.select` for one quantized weight shape and format, kept in the tactic cache under the
    shape, format, group, batch, layer count, candidate list and kernel source, as
    `_timings` keeps the dense kernel's. `qm` is the quant_matmul module (it needs Triton)."""
    from trtbuild.store.tactics import write_atomic

    cached, configs = _quant_timing_file(qm, job, layers, rows, key)
    if cached.is_file():
        result: dict[str, Any] = json.loads(cached.read_text()) | {"reused": True}
        return result
    job.progress(f"timing quantized decode matmuls for batch {rows}, {key_name(key)} ({len(layers)} matrices): "
                 f"{len(configs)} kernel configurations")
    result = qm.select(layers, rows, configs=configs, epilogue=site_fusion(key[2]))
    write_atomic(cached, json.dumps(result, indent=1, sort_keys=True).encode())
    return result


def fusion_of(linear: Any, mode: str) -> str:
    """What the kernel does besides the matmul for this Linear: the part of its call site's fusion after the
    matmul (`epilogue`), unless the recipe turns fusion off or the Linear has a bias (the kernel adds none)."""
    if mode == "none" or linear.bias is not None:
        return "none"
    return EPILOGUE[linear.fusion]


def attention_plan(cfg: Any, dtype: Any, mode: str, device: str) -> dict[str, str]:
    """Whether the decode graphs use trtbuild's decode attention kernel, and how:
    {"used": "kernel" | "aten", "note"}."""
    if mode == "aten":
        return {"used": "aten", "note": "options.decode_attention is aten"}
    why = None if device.startswith("cuda") else "a CPU build"
    if why is None:
        try:
            from trtbuild.kernels import decode_attention
        except ImportError as e:  # torch's CUDA wheels bring Triton; a source build may not
            why = f"the kernel needs Triton ({e})"
        else:
            why = decode_attention.supports(cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, dtype)
    if why is None:  # a family whose attention the kernel does not do (qk norms, windows, ...) keeps ATen's
        from trtbuild.models.families import attention_kernel_limits

        why = attention_kernel_limits(cfg)
    if why is None:
        return {"used": "kernel", "note": f"options.decode_attention is {mode}"}
    if mode == "kernel":
        raise TrtbuildError(f"options.decode_attention: {mode!r} cannot serve this build: {why}")
    return {"used": "aten", "note": f"aten: {why}"}


@contextlib.contextmanager
def routed(model: Any, configs: dict[MatmulKey, Any], attention: str = "aten") -> Iterator[None]:
    """Point each Linear whose (weight shape, fusion) is in `configs` at the decode matmul kernel
    (with its call site's epilogue where the key has it, the matmul alone where it has "none", as
    `Linear.decode_fusion`), and each Attention
    at the decode attention kernel as `attention` says (an Attention.decode_kernel value), for one export."""
    from trtbuild.models.llama import Attention, Linear

    # a quantized Linear's key is its format's, which `export.quantized_decode` routes
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.quant is None]
    attentions = [m for m in model.modules() if isinstance(m, Attention)]
    for m in linears:
        outer = EPILOGUE[m.fusion]
        fusion = outer if outer != "none" and (m.out_features, m.in_features, outer) in configs else "none"
        m.decode_config = configs.get((m.out_features, m.in_features, fusion))
        m.decode_fusion = fusion
    for a in attentions:
        a.decode_kernel = attention
    try:
        yield
    finally:
        for m in linears:
            m.decode_config = None
            m.decode_fusion = "none"
        for a in attentions:
            a.decode_kernel = "aten"


def sources_called(program_text: str) -> str:
    """The source digests of the kernels a program calls, for the compiled-graph cache's key: a custom
    op's arguments are in the program's text, its kernel's source is not."""
    return "".join(f"\0{op} {importlib.import_module(module).source_digest()}"
                   for op, module in KERNEL_MODULES.items() if op in program_text)
