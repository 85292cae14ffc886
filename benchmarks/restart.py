"""The benchmark's restart section, and the new processes it and the build section run.

A restart is a new process from its start to the first token of a cached engine, from a cold page cache
and from a warm one, set against reading the engine's weights into device memory (the floor: the faster
of a plain double-buffered read and trtbuild's threaded reader). Each child is `bench.py --child KIND`,
so it starts as a user's process does, with nothing loaded.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().with_name("bench.py")
CHILD_TIMEOUT_S = int(os.environ.get("BENCH_CHILD_TIMEOUT_S", "1800"))


def drop_page_cache(files: list[Path]) -> str:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return (f"posix_fadvise(POSIX_FADV_DONTNEED) on {len(files)} file(s); the kernel (or gVisor) may ignore it: "
            "compare the cold and warm read rates to see whether it took effect")


def read_to_device(files: list[Path], device: str, chunk: int = 64 << 20) -> dict[str, float]:
    """The floor: the files' bytes into preallocated device memory (double-buffered pinned reads)."""
    import torch

    cuda = device.startswith("cuda")
    dsts = [torch.empty(f.stat().st_size, dtype=torch.uint8, device=device) for f in files]
    bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    events = [torch.cuda.Event() if cuda else None for _ in range(2)]
    t = time.perf_counter()
    for f, dst in zip(files, dsts, strict=True):
        with open(f, "rb", buffering=0) as fh:
            off, i = 0, 0
            while off < dst.numel():
                if not cuda:
                    off += fh.readinto(dst.numpy().data[off:off + chunk])
                    continue
                buf, ev = bufs[i % 2], events[i % 2]
                ev.synchronize()  # type: ignore[union-attr]  # this buffer's previous copy is done
                n = fh.readinto(buf.numpy().data[:min(chunk, dst.numel() - off)])
                dst[off:off + n].copy_(buf[:n], non_blocking=True)
                ev.record()  # type: ignore[union-attr]
                off, i = off + n, i + 1
    if cuda:
        torch.cuda.synchronize()
    s = time.perf_counter() - t
    size = sum(d.numel() for d in dsts)
    return {"s": s, "bytes": size, "Bps": size / s}


def read_with_threads(files: list[Path], device: str, threads: int) -> dict[str, float]:
    """The same floor through trtbuild's threaded reader (TRTBUILD_LOAD_THREADS): the faster of the
    two readers is the floor, so an engine that loads with this one is not judged against a slower one."""
    from trtbuild.backends.torch.weights_reader import read_safetensors
    from trtbuild.timing import sync

    sync(device)
    t = time.perf_counter()
    for f in files:
        read_safetensors(f, device, threads)
    sync(device)
    size = sum(f.stat().st_size for f in files)  # as the one-thread floor counts: the whole files
    s = time.perf_counter() - t
    return {"s": s, "bytes": size, "Bps": size / s, "threads": threads}


def child(kind: str, recipe_path: str, engines: str, extra: list[str],
          env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `bench.py --child KIND` in a new process; its last stdout line is JSON."""
    t0 = time.time()
    try:
        p = subprocess.run([sys.executable, str(BENCH), "--child", kind, recipe_path, "--engines", engines, *extra],
                           capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return {"error": f"child timed out after {CHILD_TIMEOUT_S} s", "returncode": None}
    wall = time.time() - t0
    try:
        out = json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        why = f"signal {-p.returncode}" if p.returncode < 0 else f"exit code {p.returncode}"
        return {"error": f"child crashed ({why}): {p.stderr.strip()[-800:]}", "returncode": p.returncode}
    return {**out, "t_spawn": t0, "wall_s": wall}


def child_main(kind: str, recipe_path: str, engines: str, prompt_len: int) -> None:
    t_main = time.time()
    if kind == "startup":  # what any restart that imports torch pays before it can touch an engine
        import torch

        if torch.cuda.is_available():
            torch.zeros(1, device="cuda")
            torch.cuda.synchronize()
        print(json.dumps({"t_main": t_main, "t_ready": time.time()}), flush=True)
        return
    from trtbuild.builder import build
    from trtbuild.recipe import load_recipe

    recipe = load_recipe(recipe_path)
    if kind == "build":
        o = build(recipe, engines)
        print(json.dumps({"build_s": o.build_s, "phases": o.phases, "cache_hit": o.cache_hit, "key": o.key}))
        return
    from trtbuild.runner import default_prompt, open_session, vocab_size

    with open_session(recipe, engines, build=False) as s:
        t_loaded = time.time()
        gen = s.engine.generate(default_prompt(1, prompt_len, vocab_size(recipe, s)), 1)  # .tolist() syncs
        t_first = time.time()
        print(json.dumps({"t_main": t_main, "t_loaded": t_loaded, "t_first_token": t_first, "phases": s.phases,
                          "prefill_s": gen.prefill_s, "load_note": getattr(s.engine, "load_note", ""),
                          "load_parts": getattr(s.engine, "load_parts", {})}), flush=True)


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median time to the first token (any failed run instead: a failure is never averaged
    away), with every run's time beside it when there were several."""
    failed = [r for r in runs if "error" in r]
    if failed:
        return failed[0]
    ranked = sorted(runs, key=lambda r: r["start_to_first_token_s"])
    median = ranked[(len(ranked) - 1) // 2]
    return median | ({"samples_s": [r["start_to_first_token_s"] for r in runs]} if len(runs) > 1 else {})


def measure_restart(ctx: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The restart section for the engine entry `ctx["entry"]`: per page cache (cold, then warm) each reader's
    restart in a new process and its read floor, the ratios to the fastest floor, and, warm, what a process
    that only imports torch takes."""
    entry: Path = ctx["entry"]
    files = sorted(p for p in entry.rglob("*") if p.is_file())
    weights = [entry / "weights.safetensors"] if (entry / "weights.safetensors").is_file() else files
    out: dict[str, Any] = {"weight_files": [str(w) for w in weights], "engine_files": len(files)}
    threads = args.load_threads if (entry / "weights.safetensors").is_file() else 0
    # (reader, the engine's environment, the floor read the same way, or None): each engine restart is
    # followed by its floor, both from a dropped page cache in the cold round. The threaded reader runs
    # twice: without (TRTBUILD_PRELOAD=0, whatever the default) and with the weights preloaded onto the GPU
    # while torch imports (TRTBUILD_PRELOAD=1: backends/weights_preload.py), an A/B in the same run.
    readers: list[tuple[str, dict[str, str], Callable[[], dict[str, float]] | None]] = [
        ("one_thread", {"TRTBUILD_LOAD_THREADS": "0"}, lambda: read_to_device(weights, ctx["device"]))]
    if threads:
        readers.append((f"threads_{threads}", {"TRTBUILD_LOAD_THREADS": str(threads), "TRTBUILD_PRELOAD": "0"},
                        lambda: read_with_threads(weights, ctx["device"], threads)))
        readers.append((f"threads_{threads}_preload", {"TRTBUILD_LOAD_THREADS": str(threads), "TRTBUILD_PRELOAD": "1"},
                        None))
    # --preload-threads: the preload again with other thread counts. On the H200 (2026-12-05, commit 5637554) the
    # warm 8-thread preload read for 2.32 s during start-up (0.65 s alone) and start-up took 1.1 s longer:
    # fewer threads may contend less with the import they overlap
    others = [n for n in args.preload_threads if threads and n != threads]
    for n in others:
        readers.append((f"threads_{n}_preload", {"TRTBUILD_LOAD_THREADS": str(n), "TRTBUILD_PRELOAD": "1"}, None))
    for cache in ("cold", "warm"):
        cold = cache == "cold"
        note = "files just read (warm page cache)"
        starts: dict[str, dict[str, Any]] = {}
        floors: dict[str, dict[str, float]] = {}
        for reader, env, read_floor in readers:
            if cold:
                note = drop_page_cache(files)
            # warm, each restart --restart-repeats times, the median kept: one sample's start-up moved by
            # ±0.5 s between rows of one run on the H200 (2026-12-05), the size of the differences measured
            runs = [child("restart", args.recipe_path, args.engines, ["--prompt-len", str(ctx["plan"].prompt_len)], env)
                    for _ in range(1 if cold else max(1, args.restart_repeats))]
            for r in runs:
                if "error" not in r:
                    r["start_to_first_token_s"] = r["t_first_token"] - r["t_spawn"]
            starts[reader] = _median_run(runs)
            if read_floor is not None:
                if cold:
                    drop_page_cache(weights)
                floors[reader] = read_floor()
        fastest = min(floors, key=lambda k: floors[k]["s"])

        def ratio(r: dict[str, Any], floor_s: float = floors[fastest]["s"]) -> float:
            return r.get("start_to_first_token_s", float("nan")) / floor_s

        rec: dict[str, Any] = {"page_cache": note, "engine": starts["one_thread"],
                               "read_weights_to_device": floors[fastest] | {"reader": fastest}, "floors": floors,
                               "ratio_to_floor": ratio(starts["one_thread"])}
        if not cold:
            # the floor of any restart that imports torch: a new process that imports it and makes one tensor on
            # the device, against the same read floor (the warm target is 2x the read)
            ready = child("startup", args.recipe_path, args.engines, [])
            if "error" not in ready:
                ready["start_to_ready_s"] = ready["t_ready"] - ready["t_spawn"]
                ready["ratio_to_floor"] = ready["start_to_ready_s"] / floors[fastest]["s"]
            rec["torch_process_floor"] = ready
        if threads:
            rec["engine_load_threads"] = starts[f"threads_{threads}"]
            rec["ratio_to_floor_load_threads"] = ratio(starts[f"threads_{threads}"])
            rec["engine_load_threads_preload"] = starts[f"threads_{threads}_preload"]
            rec["ratio_to_floor_load_threads_preload"] = ratio(starts[f"threads_{threads}_preload"])
        if others:
            rec["engine_preload_by_threads"] = {str(n): starts[f"threads_{n}_preload"] | {
                "ratio_to_floor": ratio(starts[f"threads_{n}_preload"])} for n in others}
        out[cache] = rec
    return out
