"""Quantized decode matmuls: every candidate of trtbuild's quantized kernel against bf16, per weight shape.

For Llama-3.2-1B's and Llama-3.1-8B's decode weight shapes (QKV, output, gate/up, down; the LM head, bf16 in a
quantized engine, only with `--head`, and apart: what quantizing it would buy), at each batch, this times inside
CUDA graphs:
  - torch's bf16 matmul (`F.linear`, cuBLAS) and the dense decode kernel's best of a few of its candidates
    (`DENSE`: its usual winners on the H100/H200, RESULTS.md), the bf16 engine's two ways;
  - every candidate of `trtbuild.kernels.quant_matmul` for int4 (groups of 128) and fp8, exactly as the build's
    selection (`quant_matmul.select`: each checked against the dequantized matmul first);
  - torchao's int4 (tinygemm) and float8 weight-only Linears where `import torchao` works, through torch.compile
    (skipped cleanly, with the reason, if not);
and sets each against its bytes floor: the weight and scale bytes read at the copy rate measured in the same
run (bytes read + written per second, as bench.py counts it). Each shape is timed over enough distinct
matrices (at least a model's layers, and 256 MiB) that none is served from the 50 MB L2 as a repeat.
The step's matmuls are then summed per format with each shape's fastest way, against bf16's.

Triton compiles every candidate before any timing, in `--jobs` processes that fill its on-disk cache (a
candidate compiled there is loaded, not compiled again, by the timing process); the compile seconds are
reported. Writes quant_probe.json and quant_probe.md under --out, the JSON after every shape (a probe cut off
by its time limit keeps what it measured). Needs CUDA and Triton.

    python3 benchmarks/probes/quant_probe.py --out $OUT
    python3 benchmarks/probes/quant_probe.py --models 8b --batches 1 --formats int4 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# Llama decode weight shapes: hidden, intermediate, q heads, kv heads, head_dim, vocab, layers
MODELS = {"1b": (2048, 8192, 32, 8, 64, 128256, 16), "8b": (4096, 14336, 32, 8, 128, 128256, 32)}
FORMATS = ("int4", "fp8")
GROUP = 128  # int4's group at these widths (models/quantize.py: 128 where it divides the width)
MIN_BYTES = 256 << 20  # the least a shape's distinct matrices hold: 5x the H100's L2
MAX_COPIES = 512
# The dense kernel's configurations timed for its best: the batch-1 winners at 1B/8B (n2k2048, n4k2048, n4k1024,
# n8k1024) and the tensor-core path's usual ones (RESULTS.md).
DENSE = {"one": ["n2k2048w4s1", "n4k2048w4s1", "n4k1024w4s3", "n8k1024w4s1", "n2k4096w4s1"],
         "rows": ["n16k256w4s3", "n16k512w4s4", "n32k256w4s4", "n32k512w4s3"]}


def shapes(model: str) -> dict[str, tuple[int, int]]:
    """The per-layer [out, in] weights a decode step reads (QKV and gate/up fused, as the model holds them)."""
    d, f, h, kv, hd, _, _ = MODELS[model]
    return {"qkv": ((h + 2 * kv) * hd, d), "o": (d, h * hd), "gate_up": (2 * f, d), "down": (d, f)}


def quant_bytes(fmt: str, n: int, k: int) -> int:
    """Bytes one quantized [n, k] weight reads: the weight and its scales (int4: a bf16 scale and zero a group;
    fp8: an fp32 scale a row)."""
    return n * k // 2 + n * (k // GROUP) * 4 if fmt == "int4" else n * k + n * 4


def copies(nbytes: int, layers: int) -> int:
    """Distinct matrices to time one shape over: a model's layers, and enough that they overflow the L2."""
    return min(MAX_COPIES, max(layers, math.ceil(MIN_BYTES / nbytes)))


def dense_configs(rows: int, k: int) -> list[Any]:
    from trtbuild.kernels.matmul_configs import MatmulConfig

    names = DENSE["one"] if rows == 1 else DENSE["rows"]
    return [c for c in map(MatmulConfig.parse, names) if c.block_k <= max(k, 1024)]


def plan(models: list[str], batches: list[int], formats: list[str], sms: int,
         head: bool = False) -> list[dict[str, Any]]:
    """Every (model, shape, batch, format or "bf16") to time and its candidates: the build's own lists
    (`quant_candidates`), so the probe's enumeration is the build's. With `head`, the LM head's shape too (read
    once a step): what quantizing it would buy."""
    from trtbuild.kernels.matmul_configs import quant_candidates

    work = []
    for model in models:
        d, vocab = MODELS[model][0], MODELS[model][5]
        for name, (n, k) in (shapes(model) | ({"head": (vocab, d)} if head else {})).items():
            for rows in batches:
                work.append({"model": model, "shape": name, "n": n, "k": k, "rows": rows, "format": "bf16",
                             "configs": [c.name for c in dense_configs(rows, k)]})
                for fmt in formats:
                    configs = quant_candidates(fmt, rows, n, k, GROUP if fmt == "int4" else 0, sms)
                    work.append({"model": model, "shape": name, "n": n, "k": k, "rows": rows, "format": fmt,
                                 "configs": [c.name for c in configs]})
    return work


def compile_keys(work: list[dict[str, Any]]) -> list[tuple[str, int, int, str]]:
    """The distinct (format, rows, k, config) launches to compile. Triton specializes the kernels on the one-row
    case, on 16-divisibility and on their compile-time flags, not on N or K, which are run-time arguments: of
    k only whether the step divides it matters (EVEN_K), so one small launch per key, at a width that divides
    like the real one, compiles what the timing uses."""
    from trtbuild.kernels.matmul_configs import MatmulConfig

    def width(k: int, name: str) -> int:
        return 8192 if k % MatmulConfig.parse(name).block_k == 0 else k

    return sorted({(w["format"], 1 if w["rows"] == 1 else 2, width(w["k"], c), c) for w in work for c in w["configs"]})


def _compile_one(key: tuple[str, int, int, str]) -> tuple[str, float | str]:
    """One launch in a worker process (which fills Triton's on-disk cache); its seconds or its error."""
    import torch

    from trtbuild.kernels.matmul_configs import MatmulConfig

    fmt, rows, k, name = key
    t = time.perf_counter()
    try:
        layer = make_layers(fmt, 64, k, 1)[0]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        config = MatmulConfig.parse(name)
        if fmt == "bf16":
            from trtbuild.kernels.decode_matmul import decode_matmul

            decode_matmul(x, layer[0], config)
        else:
            from trtbuild.kernels.quant_matmul import quant_matmul

            quant_matmul(x, *layer, config)
        torch.cuda.synchronize()
    except Exception as e:  # recorded; the timing process compiles it again and records its failure there
        return f"{fmt} {name}", f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return f"{fmt} {name}", time.perf_counter() - t


def make_layers(fmt: str, n: int, k: int, count: int) -> list[tuple[Any, Any, Any]]:
    """`count` distinct random weights as the engine stores them: (weight, None, None) for bf16, (qweight, scale,
    zero) for int4 (zero None for fp8). Random codes are as fast to read as calibrated ones."""
    import torch

    out = []
    for _ in range(count):
        if fmt == "bf16":
            out.append((torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, None, None))
        elif fmt == "int4":
            q = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8)
            s = (torch.rand(n, k // GROUP, device="cuda") * 0.01 + 0.001).to(torch.bfloat16)
            z = (torch.rand(n, k // GROUP, device="cuda") * 4 + 6).to(torch.bfloat16)
            out.append((q, s, z))
        else:
            q = (torch.randn(n, k, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            out.append((q, torch.rand(n, device="cuda") * 1e-3 + 1e-4, None))
    return out


def time_bf16(layers: list[tuple[Any, Any, Any]], rows: int, configs: list[str], reps: int) -> dict[str, Any]:
    """torch's F.linear and the dense kernel's configurations over the same bf16 matrices, µs a call."""
    import torch
    import torch.nn.functional as F

    from trtbuild.kernels.decode_matmul import decode_matmul
    from trtbuild.kernels.matmul_configs import MatmulConfig
    from trtbuild.timing import graph_seconds

    weights = [w for w, _, _ in layers]
    x = torch.randn(rows, weights[0].shape[1], device="cuda", dtype=torch.bfloat16)
    ys = [torch.empty(rows, weights[0].shape[0], device="cuda", dtype=torch.bfloat16) for _ in weights]
    ref = F.linear(x, weights[0]).float()

    def torch_calls() -> None:
        for w, y in zip(weights, ys, strict=True):
            torch.matmul(x, w.t(), out=y)

    row: dict[str, Any] = {"torch_us": graph_seconds(torch_calls, reps) / len(weights) * 1e6, "candidates": {}}
    for name in configs:
        config = MatmulConfig.parse(name)
        try:
            got = decode_matmul(x, weights[0], config, out=ys[0]).float()
            err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            if not err <= 2e-2:
                row["candidates"][name] = f"refused: max relative error {err:.3g}"
                continue

            def calls(config: MatmulConfig = config) -> None:
                for w, y in zip(weights, ys, strict=True):
                    decode_matmul(x, w, config, out=y)

            row["candidates"][name] = graph_seconds(calls, reps) / len(weights) * 1e6
        except Exception as e:
            row["candidates"][name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return row


def torchao_linears(fmt: str, layers: list[tuple[Any, Any, Any]], count: int) -> list[Any] | str:
    """`count` of the shape's matrices as torchao's int4 (tinygemm, group 128) or float8 weight-only Linears
    (their weights random bf16: the codes' values do not change the speed); an error string where torchao is
    absent or refuses (it is a peer, never required)."""
    try:
        import torch
        import torchao.quantization as tq

        if fmt == "int4":
            # tinygemm (torch's _weight_int4pack_mm): torchao 0.18's default packing needs the mslk package
            fields = getattr(tq.Int4WeightOnlyConfig, "__dataclass_fields__", {}) \
                if hasattr(tq, "Int4WeightOnlyConfig") else {}
            config = tq.Int4WeightOnlyConfig(group_size=GROUP, int4_packing_format="tile_packed_to_4d") \
                if "int4_packing_format" in fields else tq.Int4WeightOnlyConfig(group_size=GROUP) \
                if hasattr(tq, "Int4WeightOnlyConfig") else tq.int4_weight_only(group_size=GROUP)
        else:
            config = tq.Float8WeightOnlyConfig() if hasattr(tq, "Float8WeightOnlyConfig") else tq.float8_weight_only()
        n, k = layers[0][0].shape[0], layers[0][0].shape[1] * (2 if fmt == "int4" else 1)
        mods = []
        for _ in range(count):
            lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            tq.quantize_(lin, config)
            mods.append(lin)
        return mods
    except Exception as e:
        return f"skipped: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def time_torchao(mods: list[Any] | str, rows: int, reps: int) -> float | str:
    """µs a call of torchao's Linears through torch.compile (as torchao's own figures are measured: eager, its
    float8 weight-only Linear dequantizes the whole weight every call), inside a CUDA graph, or why not. One
    compiled function takes each Linear's weight as an input, so the shape compiles once."""
    if isinstance(mods, str):
        return mods
    try:
        import torch
        import torch.nn.functional as F

        from trtbuild.timing import graph_seconds

        x = torch.randn(rows, mods[0].in_features, device="cuda", dtype=torch.bfloat16)
        linear = torch.compile(lambda x, w: F.linear(x, w), mode="max-autotune-no-cudagraphs")
        for m in mods[:2]:  # compiled and tuned outside the timing and the capture
            linear(x, m.weight)
        torch.cuda.synchronize()

        def calls() -> None:
            for m in mods:
                linear(x, m.weight)

        return graph_seconds(calls, reps) / len(mods) * 1e6
    except Exception as e:
        return f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


def best(row: dict[str, Any]) -> tuple[str | None, float | None]:
    timed = {k: v for k, v in row["candidates"].items() if isinstance(v, float)}
    if not timed:
        return None, None
    name = min(timed, key=timed.__getitem__)
    return name, timed[name]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from trtbuild.measure import ceilings
    from trtbuild.kernels import quant_matmul as qm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    work = plan(args.models, args.batches, args.formats, sms, args.head)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "sms": sms, "torch": torch.__version__,
                              "date": time.strftime("%Y-%m-%d"), "rows": [], "steps": {}}
    keys = compile_keys(work)
    t = time.perf_counter()
    with ProcessPoolExecutor(args.jobs, mp_context=__import__("multiprocessing").get_context("spawn")) as pool:
        compiled = dict(pool.map(_compile_one, keys))
    result["compile"] = {"launches": len(keys), "jobs": args.jobs, "wall_s": time.perf_counter() - t,
                         "failed": {k: v for k, v in compiled.items() if isinstance(v, str)}}
    print(f"compiled {len(keys)} launches in {result['compile']['wall_s']:.1f} s ({args.jobs} processes)", flush=True)
    result["copy_Bps"] = copy_bps = ceilings.measure("cuda", 1 << 30, 4096)["copy_Bps"]
    save = lambda: (out / "quant_probe.json").write_text(json.dumps(result, indent=1, sort_keys=True))  # noqa: E731
    from trtbuild.kernels.matmul_configs import MatmulConfig

    peers: dict[tuple[str, str, str], Any] = {}  # torchao's Linears, made once per shape and format
    for item in work:
        if time.perf_counter() - started > args.budget_s:
            result["rows"].append({k2: item[k2] for k2 in ("model", "shape", "n", "k", "rows", "format")}
                                  | {"candidates": {}, "note": f"not timed: past --budget-s {args.budget_s}",
                                     "best": None, "best_us": None, "fastest_us": None, "floor_us": 0.0,
                                     "x_floor": None})
            continue
        fmt, n, k, rows = item["format"], item["n"], item["k"], item["rows"]
        layers_n = 1 if item["shape"] == "head" else MODELS[item["model"]][6]
        nbytes = n * k * 2 if fmt == "bf16" else quant_bytes(fmt, n, k)
        layers = make_layers(fmt, n, k, copies(nbytes, layers_n))
        t = time.perf_counter()
        if fmt == "bf16":
            row = time_bf16(layers, rows, item["configs"], args.reps)
        else:
            row = qm.select(layers, rows, args.reps, [MatmulConfig.parse(c) for c in item["configs"]])
            if args.torchao:
                peer = (item["model"], item["shape"], fmt)
                if peer not in peers:
                    peers.clear()
                    peers[peer] = torchao_linears(fmt, layers, min(len(layers), 32))
                row["torchao_us"] = time_torchao(peers[peer], rows, args.reps)
        choice, us = best(row)
        floor_us = nbytes / copy_bps * 1e6
        ways = [u for u in (us, row.get("torch_us")) if isinstance(u, float)]
        row |= {k2: item[k2] for k2 in ("model", "shape", "n", "k", "rows", "format")} | {
            "copies": len(layers), "bytes": nbytes, "floor_us": floor_us, "best": choice, "best_us": us,
            "fastest_us": min(ways) if ways else None, "x_floor": min(ways) / floor_us if ways else None,
            "seconds": time.perf_counter() - t}
        result["rows"].append(row)
        del layers
        torch.cuda.empty_cache()
        print(f"{item['model']} {item['shape']:8s} b{rows:<2d} {fmt:5s} best {choice} {us if us is None else round(us, 2)} us"
              f" (floor {floor_us:.2f}, {len(item['configs'])} candidates, {row['seconds']:.1f} s)", flush=True)
        save()
    result["steps"] = steps(result["rows"])
    result["total_s"] = time.perf_counter() - started
    save()
    (out / "quant_probe.md").write_text(table(result))
    print(table(result))
    return result


def steps(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per model, batch and format: the step's quantized matmuls (each shape's fastest way x the layers) and the
    bf16 step's (the faster of torch and the dense kernel), the LM head left out (bf16 in both engines); the LM
    head apart where it was timed (`--head`), once a step."""
    out: dict[str, Any] = {}
    for r in rows:
        if r["fastest_us"] is None:
            continue
        head = r["shape"] == "head"
        layers = 1 if head else MODELS[r["model"]][6]
        step = f"{r['model']} b{r['rows']}" + (" LM head" if head else "")
        entry = out.setdefault(step, {}).setdefault(r["format"], {"us": 0.0, "floor_us": 0.0})
        entry["us"] += r["fastest_us"] * layers
        entry["floor_us"] += r["floor_us"] * layers
    for entry in out.values():
        for fmt, e in entry.items():
            if fmt != "bf16" and "bf16" in entry:
                e["speedup_vs_bf16"] = entry["bf16"]["us"] / e["us"]
    return out


def table(result: dict[str, Any]) -> str:
    lines = [f"# Quantized decode matmuls, {result['device']}, {result['date']}",
             f"copy rate {result['copy_Bps'] / 1e12:.2f} TB/s (read + write); compile {result['compile']['launches']} "
             f"launches in {result['compile']['wall_s']:.1f} s", "",
             "| model | shape | batch | format | best | µs | torch µs | floor µs | × floor | torchao µs |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        def f(v: Any) -> str:
            return f"{v:.2f}" if isinstance(v, float) else "-" if v is None else str(v)[:40]
        lines.append(f"| {r['model']} | {r['shape']} | {r['rows']} | {r['format']} | {r['best']} | {f(r['best_us'])} | "
                     f"{f(r.get('torch_us'))} | {f(r['floor_us'])} | {f(r['x_floor'])} | {f(r.get('torchao_us'))} |")
    lines += ["", "| step (layers' matmuls, LM head apart; `LM head`: it alone) | format | µs | floor µs | vs bf16 |",
              "|---|---|---|---|---|"]
    for step, entry in result["steps"].items():
        for fmt, e in entry.items():
            lines.append(f"| {step} | {fmt} | {e['us']:.1f} | {e['floor_us']:.1f} | "
                         f"{e.get('speedup_vs_bf16', 1.0):.2f}x |")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8],
                   help="rows per call, at most 16 (the kernels' limit)")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--reps", type=int, default=10, help="graph replays timed per candidate (the median is kept)")
    p.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="compile processes")
    p.add_argument("--budget-s", type=float, default=150.0,
                   help="seconds after which no further shape is timed (the rest are listed as not timed)")
    p.add_argument("--no-torchao", dest="torchao", action="store_false", help="skip torchao's peers")
    p.add_argument("--head", action="store_true", help="time the LM head's shape in each format too, apart")
    args = p.parse_args(argv)
    if any(not 1 <= b <= 16 for b in args.batches):
        p.error("--batches: 1 to 16 rows (the kernels take at most 16)")
    return args


if __name__ == "__main__":
    run(parse())
