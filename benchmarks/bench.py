"""Engine speed against the device's ceilings and against its peers, in one run on one device.

    python benchmarks/bench.py recipes/llama-3.2-1b.yaml recipes/llama-3.1-8b.yaml --out $OUT
    python benchmarks/bench.py recipes/tiny-llama.yaml --quick --engines /tmp/e --out /tmp/o  # CPU smoke test

Order: ceilings (copy bandwidth, matmul rate), then per recipe: build (cold, then rebuild with the
tactic cache kept; in child processes), restart (new process to first token, cold and warm page
cache, against reading the weight file into device memory), then the variants (see peers.py).
Writes bench.json and bench.png under --out and prints a table last. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # trtbuild, run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # peers
import trtbuild  # noqa: E402,F401  - before torch: one libstdc++ for the compiled graphs (backends/cxx.py)

import targets  # noqa: E402
from trtbuild.measure import ceilings  # noqa: E402
from trtbuild.measure.ceilings import time_op  # noqa: E402  - the variants time with it too
from trtbuild.backends.torch.inductor import DTYPE_NAMES  # noqa: E402
from trtbuild.models.families import unread_expert_parameters  # noqa: E402
from restart import child, child_main, measure_restart  # noqa: E402

VARIANTS = ("engine", "eager", "compile", "hf")
SECTIONS = ("build", "restart", "variants")


@dataclass(frozen=True)
class Plan:
    prompt_len: int  # prompt before the timed decode steps
    new_tokens: int  # tokens per timed generation (new_tokens - 1 decode steps each)
    decode_reps: int  # timed generations per batch size, after `warmup` untimed ones
    warmup: int
    prefill_lens: tuple[int, ...]
    prefill_reps: int
    copy_bytes: int
    matmul_n: int


FULL = Plan(128, 128, 2, 3, (128, 1024, 2048), 10, 2 << 30, 8192)
QUICK = Plan(8, 36, 3, 2, (8, 32, 64), 5, 64 << 20, 512)


# -- timing and ceilings ------------------------------------------------------------------------------
def measure_ceilings(device: str, plan: Plan) -> dict[str, Any]:
    """Copy bandwidth and matmul rate, by the probe `trtbuild profile` uses too (trtbuild/measure/ceilings.py)."""
    return ceilings.measure(device, plan.copy_bytes, plan.matmul_n)


# -- floors ---------------------------------------------------------------------------------------------
def decode_bytes(cfg: Any, elem: int, batch: int, mean_len: float, weight_bytes: float | None = None) -> float:
    """Weights a step must read (the embedding table only when it is also the LM head) + filled KV cache.
    `weight_bytes`: the weights' own bytes where they are not `elem` each (a quantized engine's stored
    tensors, scales and zeros included: `stored_weight_bytes`)."""
    weights = cfg.num_parameters() - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    # a mixture of experts: the chosen experts' weights only (families.unread_expert_parameters)
    weights -= unread_expert_parameters(cfg, batch)
    kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * mean_len
    return (weights * elem if weight_bytes is None else weight_bytes) + kv * elem


def stored_weight_bytes(entry: Path) -> float | None:
    """A quantized torch engine's weight bytes a decode step reads, from its weights file's header (every
    tensor but the embedding table, unless it is the LM head too); None for a dense engine."""
    spec = json.loads((entry / "engine.json").read_text())
    if not spec.get("quantization"):
        return None
    from safetensors import safe_open

    with safe_open(str(entry / "weights.safetensors"), framework="pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    width = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "I8": 1, "U8": 1}
    return float(sum(math.prod(s) * width[dtypes[k]] for k, s in sizes.items()
                     if k != "tok_embeddings.weight" or spec["tied_output"]))


def prefill_bytes(cfg: Any, elem: int, t: int) -> float:
    """What a prefill of t tokens (batch 1) must move at least: every weight read once, its keys and values
    written. A short prompt is bound by this, not by its FLOPs: at 8B, 128 tokens take 2.3 ms of the
    H200's measured matmul rate and 3.5 ms to read the weights."""
    return decode_bytes(cfg, elem, 1, t)


def prefill_flops(cfg: Any, t: int) -> float:
    from trtbuild.models.families import token_matmul_flops

    c = cfg
    attention = 2 * 2 * c.num_layers * c.num_heads * c.head_dim * t * (t + 1) / 2  # causal QK^T and PV
    return token_matmul_flops(c) * t + attention + 2 * c.hidden_size * c.vocab_size  # head: last position


def prefill_floors(cfg: Any, elem: int, lens: Sequence[int], ceilings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each length's floor, the larger of its two bounds (a roofline: the matmuls cannot run faster than the
    weights arrive, nor than the tensor cores compute), and which bound it is."""
    flops = {str(t): prefill_flops(cfg, t) for t in lens}
    moved = {str(t): prefill_bytes(cfg, elem, t) for t in lens}
    compute = {t: f / ceilings["matmul_flops_per_s"] for t, f in flops.items()}
    memory = {t: b / ceilings["copy_Bps"] for t, b in moved.items()}
    return {"prefill_s": {t: max(compute[t], memory[t]) for t in compute},
            "prefill_bound": {t: "compute" if compute[t] >= memory[t] else "memory" for t in compute},
            "prefill_flops": flops, "prefill_bytes": moved}


# -- variants -------------------------------------------------------------------------------------------
def measure_peer(peer: Any, plan: Plan, batches: list[int], vocab: int, out: dict[str, Any],
                 saved: Callable[[], None]) -> None:
    """Fill `out` one figure at a time, calling `saved` after each: a peer that runs out of the
    call's time (torch.compile's autotuning has) keeps the batch sizes and lengths it finished.

    The order: decode at the smallest batch, then every prefill length (batch 1), then the larger
    batches. A compiled peer's prefill graph is compiled by its first generation, and each further decode
    batch is a new graph to compile (and autotune): on the 8B shape torch.compile's batch-8 decode graph
    outlasted a whole 10-minute device call (RESULTS.md, 2026-12-04 H200) and took the prefill rows, which
    would have taken seconds, with it."""
    from trtbuild.runner import default_prompt
    from trtbuild.timing import percentiles

    out.update(label=peer.label, decode={}, prefill={}, complete=False)
    first, *rest = sorted(batches)
    for kind, n in [("decode", first)] + [("prefill", t) for t in plan.prefill_lens] + [("decode", b) for b in rest]:
        if kind == "decode":
            prompts = default_prompt(n, plan.prompt_len, vocab)
            for _ in range(plan.warmup):  # same shapes as the timed runs: compiles/captures happen here
                peer.generate(prompts, plan.new_tokens)
            generations = [peer.generate(prompts, plan.new_tokens)[1] for _ in range(plan.decode_reps)]
            steps = [s for g in generations for s in g]
            out["decode"][str(n)] = {**percentiles(steps), "n": len(steps), "p50_by_position": by_position(generations),
                                     # every position's own median, to find where a slow stretch starts (not printed)
                                     "p50_each_position": by_position(generations, min(len(g) for g in generations))}
            out["label"] = peer.label  # some peers only know what ran after the first call
        else:
            prompt = default_prompt(1, n, vocab)
            for _ in range(2):
                peer.generate(prompt, 1)
            samples = [peer.generate(prompt, 1)[0] for _ in range(plan.prefill_reps)]
            out["prefill"][str(n)] = {"p50": statistics.median(samples), "n": len(samples)}
        saved()
    out["complete"] = True


def by_position(generations: list[list[float]], parts: int = 4) -> list[float]:
    """The median step in each of `parts` stretches of a generation's positions, over every generation.

    A p90 well above the p50 is either a stretch of positions that runs slower (a longer cache to attend
    over, a kernel's grid changing with it) or a tail at any position (the host, the clocks); the 8B
    engine's batch-1 p90 ran 0.3 ms above its p50 on the H200 while batch 8's did not (RESULTS.md,
    2026-12-05 H200), and the percentiles alone cannot tell which."""
    shortest = min(len(g) for g in generations)
    bounds = [shortest * i // parts for i in range(parts + 1)]
    return [statistics.median(s for g in generations for s in g[lo:hi])
            for lo, hi in zip(bounds, bounds[1:], strict=False) if hi > lo]


def make_peer(name: str, ctx: dict[str, Any], args: argparse.Namespace, notes: list[str]) -> Any:
    import peers

    recipe, device, dtype, folder = ctx["recipe"], ctx["device"], ctx["dtype"], ctx["folder"]
    shapes = recipe.shapes
    if name == "engine":
        return peers.EnginePeer(recipe, args.engines)
    if name.startswith("engine@"):  # the same recipe built another way: an A/B, not a peer
        return engine_variant(recipe, name.split("@", 1)[1], args.engines, notes)
    if name in ("eager", "compile"):
        model = peers.load_transformer(folder, dtype, device, shapes.max_batch_size, shapes.max_seq_len)
        return peers.TransformerPeer(model, device, compiled=name == "compile")
    from trtbuild.runner import default_prompt

    probe = default_prompt(1, ctx["plan"].prompt_len, ctx["vocab"])
    hf_mode = args.hf_mode if args.hf_mode != "auto" or device.startswith("cuda") else "eager"
    if hf_mode != args.hf_mode:
        notes.append("hf: static cache is compiled only on accelerators; on CPU the eager mode ran")
    peer, hf_notes = peers.hf_peer(folder, dtype, device, hf_mode, probe, ctx["plan"].new_tokens)
    notes.extend(hf_notes)
    return peer


# engine@SPEC: one recipe option changed, for A/B runs of trtbuild's own kernels
ENGINE_VARIANTS = {"cublas": ("decode_matmul", "cublas", "no trtbuild decode matmul kernel"),
                   "moe-kernel": ("moe_decode", "kernel", "trtbuild's Triton gather of the chosen experts in decode"),
                   "moe-grouped": ("moe_prefill", "grouped", "prompts' tokens grouped by expert (torch._grouped_mm)"),
                   "kernel": ("decode_matmul", "kernel", "trtbuild's decode matmul kernel for every matmul"),
                   "aten-attention": ("decode_attention", "aten", "no trtbuild decode attention kernel"),
                   "sdpa-prefill": ("prefill_attention", "sdpa", "prefill attention through SDPA's dispatch"),
                   "cudnn-prefill": ("prefill_attention", "cudnn", "prefill attention through cuDNN's"),
                   "split-k": ("decode_split_k", "timed", "split-K decode matmul configurations timed too"),
                   "epilogue": ("decode_fusion", "epilogue", "decode matmul kernel fused with the gating and residual adds"),
                   # the default before 2026-12-04 (epilogue measured then), for A/B runs against the default epilogue
                   "no-epilogue": ("decode_fusion", "none", "decode matmul kernel alone, Inductor's gating and residual adds")}


# engine@no-pdl: the recipe's own engine (the same entry, a cache hit) with its decode graphs captured
# without programmatic dependent launch (TRTBUILD_PDL=0): an A/B of the launch alone, no build
NO_PDL = "no-pdl"

# engine@no-prefill-graphs: the recipe's own engine (a cache hit) with its prefill called directly, not replayed
# from captured graphs (TRTBUILD_PREFILL_GRAPHS=0, prefill_graphs.py): an A/B of the prefill's launch alone
NO_PREFILL_GRAPHS = "no-prefill-graphs"

# engine@again: the recipe's own engine (the same entry) measured once more, last: the run's drift. On the
# H200 one prefill graph measured 48.9 and 51.2 ms one after the other in one run (RESULTS.md, 2026-12-04
# H200), so a row won by 2% needs this bracket before it is called a lead.
AGAIN = "again"

# the variants that measure the recipe's own entry, kept after their measurement
SAME_ENTRY = (NO_PDL, NO_PREFILL_GRAPHS, AGAIN)

# engine@serial: the recipe's own engine with every graph compiled in the build process
# (TRTBUILD_COMPILE_WORKERS=0), against the default, whose workers compile side by side
SERIAL = "serial"


def fresh_store(main: Path, suffix: str) -> Path:
    """An empty store beside `main` (no engines, no tactic cache) sharing its model files."""
    root = Path(f"{main}-{suffix}")
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    (root / "models").symlink_to(main / "models")
    return root


def adopt(src: Any, dst: Any, key: str) -> Any:
    """Move the engine of `key` from store `src` into store `dst`, published there as a build is (hashed
    again, manifest last, renamed into place), so the sections after a build in a fresh store find it
    instead of building it a third time (on 2026-12-04 an 8B benchmark ran out of time doing that). None
    when `src` has no such engine or `dst` already has one."""
    from trtbuild.store.local import MANIFEST

    entry = src.lookup(key)
    if entry is None or dst.lookup(key) is not None:
        return None
    dst.ensure()
    work = dst.new_workdir(entry.name, key)
    for item in entry.path.iterdir():
        if item.name != MANIFEST:
            os.replace(item, work / item.name)  # same filesystem: a rename, not a copy of the weights
    shutil.rmtree(entry.path)
    manifest = {k: v for k, v in entry.manifest.items() if k not in ("files", "verified")}
    return dst.publish(work, entry.name, key, manifest)


def engine_variant(recipe: Any, spec: str, engines: str, notes: list[str]) -> Any:
    """The recipe's engine built another way: `spec` is a tactics level, a key of ENGINE_VARIANTS
    (one recipe option), or `serial`. Built here if the store has none; its own key, so it never
    shadows the recipe's engine. `serial` has the recipe's key (compile workers are not part of an
    engine), so it is built in a fresh store of its own, where no compiled graph can be reused. For
    A/B runs inside one benchmark."""
    import dataclasses

    import peers
    from trtbuild.builder import build
    from trtbuild.store.local import Store

    if spec == NO_PDL:
        peer = peers.EnginePeer(recipe, engines)
        engine: Any = peer.session.engine  # the torch backend's engine (the Engine protocol has no PDL)
        engine.pdl_allowed = False
        peer.label += ", decode graphs captured without PDL (TRTBUILD_PDL=0)"
        return peer
    if spec == NO_PREFILL_GRAPHS:
        peer = peers.EnginePeer(recipe, engines)
        torch_engine: Any = peer.session.engine  # the torch backend's (the Engine protocol has no prefill graphs)
        torch_engine.prefill_graph_limit = 0  # read when the first prefill runs
        peer.label += ", prefill called directly, no captured graphs (TRTBUILD_PREFILL_GRAPHS=0)"
        return peer
    if spec == AGAIN:
        peer = peers.EnginePeer(recipe, engines)
        peer.label += ", measured again after the variants before it (the run's drift)"
        return peer
    if spec == SERIAL:
        variant, level = recipe, f"{recipe.tactics_level}, every graph compiled in the build process"
        engines = str(fresh_store(Store(engines).root, SERIAL))
    elif spec in ENGINE_VARIANTS:
        option, value, what = ENGINE_VARIANTS[spec]
        variant = dataclasses.replace(recipe, options={**recipe.options, option: value})
        level = f"{recipe.tactics_level}, options.{option} {value} ({what})"
    else:
        variant, level = dataclasses.replace(recipe, tactics_level=spec), spec
    t0 = time.perf_counter()
    with mock.patch.dict(os.environ, {"TRTBUILD_COMPILE_WORKERS": "0"} if spec == SERIAL else {}):
        outcome = build(variant, engines, progress=lambda m: print(
            f"[bench]   +{time.perf_counter() - t0:6.1f} s {m}", flush=True))
    tactics = outcome.entry.manifest.get("tactics", {})
    notes.append(f"tactics level {level}: " + ("cache hit" if outcome.cache_hit else
                 f"built in {outcome.build_s:.1f} s {({k: round(v, 1) for k, v in outcome.phases.items()})}, "
                 f"{tactics.get('benchmarked', 0)} GEMM candidates benchmarked, compiled graphs reused "
                 f"{tactics.get('compiled_graphs_reused', [])}"))
    if not outcome.cache_hit:
        build(variant, engines)  # the first lookup after a publish hashes every file: not in the timings
    peer = peers.EnginePeer(variant, engines)
    peer.label += f", tactics level {level}"
    return peer


def run_variants(ctx: dict[str, Any], args: argparse.Namespace, skipped: dict[str, str], results: dict[str, Any],
                 save: Callable[[], None]) -> None:
    import peers

    batches = [b for b in ctx["recipe"].shapes.batch_buckets]
    for name in args.variants:
        if name in skipped:
            print(f"[bench] {ctx['recipe'].name}/{name}: skipped: {skipped[name]}", flush=True)
            results[name] = {"skipped": skipped[name]}
            continue
        print(f"[bench] {ctx['recipe'].name}/{name} ...", flush=True)
        notes: list[str] = []
        t = time.perf_counter()
        result: dict[str, Any] = {"notes": notes}
        results[name] = result

        def saved(result: dict[str, Any] = result, t: float = t) -> None:
            for b, d in result.get("decode", {}).items():  # ratios at once, so a run cut short has them
                d["x_floor"] = d["p50"] / ctx["floors"]["decode_s"][b]
            for n, d in result.get("prefill", {}).items():
                d["x_floor"] = d["p50"] / ctx["floors"]["prefill_s"][n]
            result["wall_s"] = time.perf_counter() - t
            save()

        peer = None
        try:
            peer = make_peer(name, ctx, args, notes)
            measure_peer(peer, ctx["plan"], batches, ctx["vocab"], result, saved)
            if hasattr(peer, "session") and hasattr(peer.session.engine, "launch_report"):
                result["launch"] = peer.session.engine.launch_report()
                result["prefill_launch"] = peer.session.engine.prefill_report()
        except Exception as exc:  # noqa: BLE001 - one failing peer must not cost the others' numbers
            result["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            print(f"[bench]   failed: {result['error']}", flush=True)
        finally:
            if peer is not None:
                peer.close()
                if name.startswith("engine@") and name not in (f"engine@{s}" for s in SAME_ENTRY) \
                        and not args.keep_variant_engines:
                    notes.append(discard_engine(peer))
            peers.free_device_memory()
        saved()


def discard_engine(peer: Any) -> str:
    """Delete an engine@ variant's engine from its store once measured; its compiled graphs stay in the
    tactic cache, so building it again takes the export and a copy. An 8B engine is 16 GB, and on
    2026-12-04 the third one of a run filled the device's 64 GB disk (No space left on device)."""
    from trtbuild.store.local import Store

    entry = peer.session.outcome.entry
    Store(peer.engines).remove(entry)
    return f"engine deleted after its measurement ({entry.path.name}; --keep-variant-engines keeps it)"


def measure_build(ctx: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    from trtbuild.builder import explain
    from trtbuild.store.local import Store

    main = Store(args.engines)
    root = main.root
    note = "cold build in the benchmark's store (no engine, no tactic cache yet)"
    tactics = main.tactics_dir
    # Cold means nothing to reuse: with an engine cached or a tactic cache present (an earlier build, or
    # one seeded from another call), the cold build goes to a fresh store.
    if explain(ctx["recipe"], args.engines)["hit"] or (tactics.is_dir() and any(tactics.iterdir())):
        root = fresh_store(main.root, "buildbench")
        note = (f"engine or tactic cache already in the benchmark's store: cold build in a fresh store {root} "
                "(models/ linked, tactics/ empty)")
    tactics_before = sum(1 for _ in (Store(root).tactics_dir).rglob("*")) if Store(root).tactics_dir.is_dir() else 0
    cold = child("build", args.recipe_path, str(root), [])
    out: dict[str, Any] = {"note": note, "tactic_cache_files_before_cold": tactics_before, "cold": cold}
    if "error" not in cold:
        store = Store(root)
        entry = store.lookup(cold["key"])
        if entry is not None:
            store.remove(entry)  # delete the engine, keep store/tactics
        out["rebuild_kept_tactics"] = warm = child("build", args.recipe_path, str(root), [])
        if "error" not in warm:
            out["ratio"] = warm["build_s"] / cold["build_s"]
            if root != main.root and adopt(store, main, cold["key"]) is not None:
                out["note"] += "; the rebuilt engine then moved into the benchmark's store for the other sections"
    if root != main.root:
        shutil.rmtree(root, ignore_errors=True)
    return out


# -- one recipe -----------------------------------------------------------------------------------------
def bench_recipe(path: str, args: argparse.Namespace, device: str, plan: Plan,
                 ceilings: dict[str, Any], res: dict[str, Any], save: Callable[[], None]) -> None:
    """Fill `res` section by section, calling `save` after each, so a run cut short keeps what it measured."""
    import torch

    from trtbuild.builder import build
    from trtbuild.models.checkpoint import read_config
    from trtbuild.models.source import resolve
    from trtbuild.recipe import load_recipe
    from trtbuild.store.local import Store

    args.recipe_path = path
    recipe = load_recipe(path)
    fits = tuple(t for t in plan.prefill_lens if t <= recipe.shapes.max_input_len)
    if fits != plan.prefill_lens:  # measured for no variant, so every row compares the same lengths
        res["prefill_lengths_skipped"] = (f"prompt lengths {', '.join(str(t) for t in plan.prefill_lens if t not in fits)}"
                                          f" exceed the recipe's max_input_len {recipe.shapes.max_input_len}: "
                                          f"not measured for any variant")
        print(f"[bench] {recipe.name}: {res['prefill_lengths_skipped']}", flush=True)
        plan = replace(plan, prefill_lens=fits)
    # the dtype the engine computes in (bf16 for the quantized precisions: their KV cache and activations)
    dtype = getattr(torch, DTYPE_NAMES[recipe.precision])
    folder = resolve(recipe.model, Store(args.engines).root).materialize()  # same synthetic weights for all
    res.update(recipe=recipe.name, path=path, precision=recipe.precision)
    if "build" in args.sections:
        print(f"[bench] {recipe.name}: build (cold, then rebuild with tactics kept) ...", flush=True)
        res["build"] = measure_build({"recipe": recipe}, args)
        save()
    t_build = time.perf_counter()

    def progress(message: str) -> None:  # a call cut off mid-build still shows how far it got
        print(f"[bench]   +{time.perf_counter() - t_build:6.1f} s {message}", flush=True)

    outcome = build(recipe, args.engines, progress=progress)  # a hit after the build section; builds here otherwise
    if not outcome.cache_hit:
        build(recipe, args.engines)  # the first lookup after a publish hashes every file: keep it out of the restart
        if "build" not in args.sections:  # still worth keeping: a cold build, in-process
            reused = outcome.entry.manifest.get("tactics", {}).get("compiled_graphs_reused", [])
            res["build"] = {"note": "build section skipped; this is the build the variants needed, in the benchmark "
                            "process" + (f"; NOT cold: compiled graphs reused from the tactic cache: {reused}"
                                         if reused else ""),
                            "cold": {"build_s": outcome.build_s, "phases": outcome.phases, "cache_hit": False,
                                     "compiled_graphs_reused": reused}}
            save()
    folder = outcome.model.materialize()
    _, cfg = read_config(folder)
    elem = torch.empty(0, dtype=dtype).element_size()
    ctx = {"recipe": recipe, "device": device, "dtype": dtype, "folder": folder, "plan": plan,
           "vocab": cfg.vocab_size, "entry": outcome.entry.path}
    mean_len = plan.prompt_len + plan.new_tokens / 2
    stored = stored_weight_bytes(outcome.entry.path)  # a quantized engine's floor is its own bytes
    res["floors"] = {
        "decode_s": {str(b): decode_bytes(cfg, elem, b, mean_len, stored) / ceilings["copy_Bps"]
                     for b in recipe.shapes.batch_buckets},
        "decode_bytes": {str(b): decode_bytes(cfg, elem, b, mean_len, stored) for b in recipe.shapes.batch_buckets},
        **prefill_floors(cfg, elem, plan.prefill_lens, ceilings),
        "mean_kv_len": mean_len}
    skipped: dict[str, str] = {}
    if "restart" in args.sections:
        print(f"[bench] {recipe.name}: restart (new process to first token) ...", flush=True)
        res["restart"] = measure_restart(ctx, args)
        save()
        crash = res["restart"]["cold"]["engine"].get("error")
        if crash and "signal" in crash:
            skipped["engine"] = f"loading the engine crashed a child process ({crash[:120]}); not loaded here"
    if not device.startswith("cuda") and not args.cpu_compile:
        skipped["compile"] = "CUDA graphs (mode='max-autotune') need a GPU; --cpu-compile runs mode='default' on CPU"
    if "variants" in args.sections:
        res["variants"] = {}
        run_variants(ctx | {"floors": res["floors"]}, args, skipped, res["variants"], save)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("recipes", nargs="+")
    ap.add_argument("--engines", default=os.environ.get("TRTBUILD_ENGINES", "/tmp/bench-engines"))
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions (smoke test)")
    ap.add_argument("--keep-variant-engines", action="store_true",
                    help="keep each engine@ variant's engine in the store after its measurement (default: deleted, "
                         "since a few 8B engines fill a disk; the recipe's own engine is always kept)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma list of {', '.join(VARIANTS)}, engine@LEVEL (the recipe at tactics level LEVEL), "
                         "engine@cublas / engine@kernel (options.decode_matmul), "
                         "engine@aten-attention (options.decode_attention), "
                         "engine@sdpa-prefill / engine@cudnn-prefill (options.prefill_attention), "
                         "engine@split-k (options.decode_split_k timed), "
                         "engine@epilogue / engine@no-epilogue (options.decode_fusion epilogue, the default, / none), "
                         "engine@serial (every graph compiled in the build process, in a fresh store), "
                         "engine@no-pdl (the engine's decode graphs captured without PDL; after engine), "
                         "engine@no-prefill-graphs (its prefill called directly, no captured graphs), "
                         "engine@again (the engine measured once more; last, to show the run's drift)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    ap.add_argument("--hf-mode", choices=("auto", "static", "eager"), default="auto")
    ap.add_argument("--cpu-compile", action="store_true", help="run the torch.compile peer on CPU (mode='default')")
    ap.add_argument("--load-threads", type=int, default=0,
                    help="restart: also time the engine with TRTBUILD_LOAD_THREADS=N and the floor with that reader")
    ap.add_argument("--restart-repeats", type=int, default=1,
                    help="restart: each warm restart this many times, the median reported (cold: once)")
    ap.add_argument("--preload-threads", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                    help="restart: the preload (the CUDA default) again with each of these thread counts")
    ap.add_argument("--child", choices=("restart", "build", "startup"), help=argparse.SUPPRESS)
    ap.add_argument("--prompt-len", type=int, default=128, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child_main(args.child, args.recipes[0], args.engines, args.prompt_len)
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch: trtbuild and the children build and run for the CPU
    import torch

    device = ("cuda:0" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    device = "cuda:0" if device == "cuda" else device
    args.variants = [v for v in args.variants.split(",") if v]
    from trtbuild.recipe import TACTIC_LEVELS

    known = [*VARIANTS, *(f"engine@{spec}" for spec in (*TACTIC_LEVELS, *ENGINE_VARIANTS, SERIAL, *SAME_ENTRY))]
    if unknown := [v for v in args.variants if v not in known]:
        ap.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(known)})")
    args.sections = [s for s in args.sections.split(",") if s]
    plan = QUICK if args.quick or device == "cpu" else FULL
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A device call's time limit ends this process with SIGTERM (`timeout`): three calls lost their whole
    # printed table that way (2026-12-04). Stop where it is and print what was measured.
    signal.signal(signal.SIGTERM, _stop)
    print(f"[bench] ceilings on {device} ...", flush=True)
    try:
        ceilings = measure_ceilings(device, plan)
    except Stopped:
        sys.exit("[bench] SIGTERM while measuring the ceilings: nothing measured")
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join(sys.argv),
                              "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
                              "torch": torch.__version__, "plan": asdict(plan), "ceilings": ceilings, "recipes": {}}
    def save() -> None:
        for rec in report["recipes"].values():  # verdicts kept current, so a run cut short has them too
            rec["targets"] = targets.check(rec)
        (out_dir / "bench.json").write_text(json.dumps(report, indent=2, default=str) + "\n")

    try:
        for path in args.recipes:
            report["recipes"][path] = {}
            bench_recipe(path, args, device, plan, ceilings, report["recipes"][path], save)
            save()
    except Stopped:
        report["stopped"] = "SIGTERM: the run was cut off; the figures are what it measured before"
        save()
        print(f"[bench] {report['stopped']}", flush=True)
    from peers import plot, table

    if "stopped" not in report:  # the plot needs every row; a cut-off run's table still shows its rows
        print(plot(report, out_dir / "bench.png"))
    print(table(report))
    print(targets.table(report))
    if "stopped" in report:
        # the status the signal would have given; os._exit, not sys.exit: a thread or process pool that
        # Inductor left running must not keep a cut-off run alive past its call's limit
        sys.stdout.flush()
        os._exit(143)


class Stopped(BaseException):
    """SIGTERM, raised where the benchmark is. Not an Exception: the handlers that keep one failing peer from
    costing the others' numbers must not swallow it."""


def _stop(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second TERM ends the process at once
    raise Stopped


if __name__ == "__main__":
    main()
