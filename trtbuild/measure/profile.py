"""The kernel profile of an engine's step: which kernel is slow, and whether memory, arithmetic or latency binds it.

One profiled prefill and decode step (a few of each, averaged), run through the engine's own path
(decode through its captured CUDA graphs on a GPU), seen by torch.profiler. Each kernel is named by its call
site (`layers.*.attention.qkv matmul`): the matmuls are found in the step's kernel sequence (four a layer and
the LM head, in the model's order), and every other kernel by the matmuls around it. Each call site's bytes
and FLOPs come from the engine's own shapes (`call_sites`), so its achieved rates can be set against the
device's measured roofs (ceilings.py) and given a verdict.

On the CPU the compiled graph's kernels are invisible to the profiler (Inductor's C++ kernels and its calls
into ATen's mm emit no profiler events), so its operators are replayed eagerly: the same model, weights,
shapes and host path, the compiled graph swapped for the module it was exported from.
"""

from __future__ import annotations

import os
import re
import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any

# Call sites, in the order a layer runs them. The matmuls anchor the sequence; the segments between them
# name the kernels that are not matmuls.
QKV = "layers.*.attention.qkv matmul"
ATTENTION = "layers.*.attention core (rope, cache, QK^T, softmax, PV)"
O_PROJ = "layers.*.attention.o matmul"
GATE_UP = "layers.*.feed_forward.gate/up matmul"
DOWN = "layers.*.feed_forward.down matmul"
LM_HEAD = "output (LM head) matmul"
BEFORE = "embedding + first norm"
AFTER = {QKV: ATTENTION, ATTENTION: ATTENTION, O_PROJ: "layers.* residual + ffn_norm",
         GATE_UP: "layers.* silu(gate) * up", DOWN: "layers.* residual + attention_norm",
         LM_HEAD: "greedy token + step bookkeeping"}
FINAL_NORM = "final norm"
MATMUL_SITES = (QKV, O_PROJ, GATE_UP, DOWN, LM_HEAD)

# A kernel within this fraction of its roof is bound by it; below it on both, it is latency-bound (too small
# to fill the device, or waiting on something else).
NEAR_ROOF = 0.5
STEPS = 8  # decode steps profiled and averaged
PREFILLS = 3  # prefills profiled and averaged
_MARK = "trtbuild.profile.step"
METHOD = {"cuda": "kernels on the device (torch.profiler with CUPTI); decode through its captured CUDA graphs",
          "cpu": "operators of the compiled graphs' source module, replayed eagerly on the engine's host path "
                 "(torch.profiler sees no kernel inside a compiled CPU graph)"}

_ATTENTION_NAME = re.compile(r"flash|fmha|attention|sdpa|softmax", re.IGNORECASE)
_MATMUL_NAME = re.compile(r"gemm|gemv|nvjet|matmul_kernel|cutlass|xmma|(^|_)(addmm|mm|bmm)(_|$)"
                          r"|^aten::(linear|addmm|mm|bmm|matmul)$", re.IGNORECASE)
_TAIL_NAME = re.compile(r"split_reduce|splitkreduce|reduce_1block", re.IGNORECASE)  # a split-K matmul's second kernel


@dataclass(frozen=True)
class Site:
    """One call site's work in one step, all layers together."""

    bytes: float  # read + written at least
    flops: float


@dataclass(frozen=True)
class Op:
    """A kernel (GPU) or top-level operator (CPU) the profiler saw, in the order it ran."""

    name: str
    us: float


# The stored tensors of each matmul call site's Linear (the model's names, every layer's together)
_SITE_WEIGHTS = {QKV: re.compile(r"^layers\.\d+\.attention\.wqkv\.(weight|qweight|scale|zero)$"),
                 O_PROJ: re.compile(r"^layers\.\d+\.attention\.wo\.(weight|qweight|scale|zero)$"),
                 GATE_UP: re.compile(r"^layers\.\d+\.feed_forward\.w13\.(weight|qweight|scale|zero)$"),
                 DOWN: re.compile(r"^layers\.\d+\.feed_forward\.w2\.(weight|qweight|scale|zero)$"),
                 LM_HEAD: re.compile(r"^output\.(weight|qweight|scale|zero)$")}


def stored_weight_bytes(weights: dict[str, Any]) -> dict[str, float]:
    """Each matmul call site's weight bytes as the engine stores them (`weights`: the model's names to tensors),
    its scales and zeros included: a quantized engine reads a byte or half a byte a weight, not the compute
    dtype's two. Sites whose tensors are not found (a tied LM head, MoE experts) are left out."""
    out: dict[str, float] = {}
    for site, pattern in _SITE_WEIGHTS.items():
        total = sum(t.numel() * t.element_size() for name, t in weights.items() if pattern.match(name))
        if total:
            out[site] = float(total)
    return out


def call_sites(cfg: Any, batch: int, tokens: int, start: float, elem: int,
               weight_bytes: dict[str, float] | None = None) -> dict[str, Site]:
    """Bytes and FLOPs of each modelled call site for a step of `batch` rows of `tokens` tokens each at
    positions start..start+tokens-1 (decode: tokens 1; prefill: start 0), weights and activations of `elem`
    bytes, or a site's weights of `weight_bytes[site]` bytes in all where given (`stored_weight_bytes`). Bytes
    are weights read once, inputs read and outputs written; the LM head sees one row a sequence."""
    d, f, v, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    n = batch * tokens
    stored = weight_bytes or {}

    def linear(site: str, k: int, m: int, rows: int, layers: int, bias: bool = False) -> Site:
        weights = stored.get(site, layers * elem * k * m)
        return Site(weights + layers * elem * (rows * k + rows * m + (m if bias else 0)), layers * 2.0 * rows * k * m)

    # Each query row at position p sees p + 1 keys; the cache slots read are the last position's + 1.
    visible = tokens * start + tokens * (tokens + 1) / 2
    slots = start + tokens
    attention = Site(L * elem * (2 * n * q + 2 * batch * kv * slots + 2 * n * kv), L * 4.0 * batch * cfg.num_heads
                     * cfg.head_dim * visible)
    return {QKV: linear(QKV, d, q + 2 * kv, n, L, cfg.qkv_bias), ATTENTION: attention,
            O_PROJ: linear(O_PROJ, q, d, n, L, cfg.o_bias), GATE_UP: linear(GATE_UP, d, 2 * f, n, L, cfg.mlp_bias),
            DOWN: linear(DOWN, f, d, n, L, cfg.mlp_bias), LM_HEAD: linear(LM_HEAD, d, v, batch, 1)}


def kind_of(name: str) -> str:
    """'matmul', 'tail' (a split-K reduction, part of the matmul before it) or 'other'."""
    if _ATTENTION_NAME.search(name):
        return "other"
    if _TAIL_NAME.search(name):
        return "tail"
    return "matmul" if _MATMUL_NAME.search(name) else "other"


def attribute(ops: list[Op], num_layers: int) -> tuple[list[tuple[str, Op]], str]:
    """Each op of one step with its call site, and a note ('' when the sequence matched the model). The
    matmuls must number k a layer (k >= 4: qkv, those of the attention, o, gate/up, down) plus the LM head;
    otherwise each op keeps its own name as its site."""
    kinds = [kind_of(op.name) for op in ops]
    anchors = [i for i, k in enumerate(kinds) if k == "matmul"]
    per, rest = divmod(len(anchors) - 1, num_layers) if anchors else (0, 1)
    if rest or per < 4:
        return ([(f"kernel {op.name}", op) for op in ops],
                f"call sites not matched: {len(anchors)} matmul kernels a step for {num_layers} layers")
    site: dict[int, str] = {}
    for layer in range(num_layers):
        a = anchors[layer * per:(layer + 1) * per]
        site |= {a[0]: QKV, a[-3]: O_PROJ, a[-2]: GATE_UP, a[-1]: DOWN} | {i: ATTENTION for i in a[1:-3]}
    site[anchors[-1]] = LM_HEAD
    last_down = anchors[-2]
    out, previous, after = [], None, BEFORE
    for i, (op, kind) in enumerate(zip(ops, kinds, strict=True)):
        if i in site:
            previous = site[i]
            after = FINAL_NORM if i == last_down else AFTER[previous]
            out.append((previous, op))
        elif kind == "tail" and previous in MATMUL_SITES:
            out.append((previous, op))
        else:
            out.append((after, op))
    return out, ""


def verdict(bytes_: float, flops: float, seconds: float, ceilings: dict[str, Any]) -> dict[str, Any]:
    """Achieved rates, their shares of the roofs, the kernel's floor and which bound applies."""
    bw, rate = ceilings["copy_Bps"], ceilings["matmul_flops_per_s"]
    floor = max(bytes_ / bw, flops / rate)
    out: dict[str, Any] = {"bytes": bytes_, "flops": flops, "floor_s": floor,
                           "intensity": flops / bytes_ if bytes_ else None,
                           "Bps": bytes_ / seconds if seconds > 0 else None,
                           "flops_per_s": flops / seconds if seconds > 0 else None}
    out["bw_fraction"] = out["Bps"] / bw if seconds > 0 else None
    out["flops_fraction"] = out["flops_per_s"] / rate if seconds > 0 else None
    roof = "memory" if bytes_ / bw >= flops / rate else "compute"  # the roof this intensity meets
    near = seconds > 0 and floor / seconds >= NEAR_ROOF
    out["verdict"] = f"{roof}-bound" if near else "latency-bound"
    return out


def table(steps: list[list[Op]], step_s: float, sites: dict[str, Site], num_layers: int,
          ceilings: dict[str, Any], profiled_s: float | None = None) -> dict[str, Any]:
    """One phase's profile from the ops of each profiled step: rows by call site, slowest first, each with its
    time and share of `step_s`, and the step's own figures (between kernels, launches, floor, the top gains).
    `profiled_s`, the step's wall time under the profiler where `step_s` is another (the engine's own)."""
    times: dict[str, float] = {}
    launches: Counter[str] = Counter()
    kernels: dict[str, dict[str, list[float]]] = {}  # site -> kernel name -> [launches, seconds]
    notes = set()
    for ops in steps:
        pairs, note = attribute(ops, num_layers)
        if note:
            notes.add(note)
        for where, op in pairs:
            times[where] = times.get(where, 0.0) + op.us / 1e6
            launches[where] += 1
            tally = kernels.setdefault(where, {}).setdefault(op.name, [0.0, 0.0])
            tally[0] += 1
            tally[1] += op.us / 1e6
    n = len(steps)
    rows = []
    for where, total in times.items():
        t = total / n
        by_time = sorted(kernels[where].items(), key=lambda kv: -kv[1][1])
        row: dict[str, Any] = {"site": where, "kernels": [{"name": k, "launches": c / n, "time_s": sec / n}
                                                          for k, (c, sec) in by_time],
                               "launches": launches[where] / n, "time_s": t,
                               "share": t / step_s if step_s > 0 else 0.0}
        if where in sites:
            row |= verdict(sites[where].bytes, sites[where].flops, t, ceilings)
        else:  # unmodelled (norms, elementwise, bookkeeping): its floor taken as 0, as fusion could remove it
            row |= {"bytes": None, "flops": None, "floor_s": 0.0, "verdict": "unmodelled"}
        row["gain_s"] = t - row["floor_s"]
        rows.append(row)
    rows.sort(key=lambda r: -r["time_s"])
    busy = sum(r["time_s"] for r in rows)
    floor = sum(verdict(s.bytes, s.flops, 1.0, ceilings)["floor_s"] for s in sites.values())
    return {"step_s": step_s, "profiled_step_s": step_s if profiled_s is None else profiled_s,
            "kernel_s": busy, "between_s": step_s - busy,
            "between_share": (step_s - busy) / step_s if step_s > 0 else 0.0,
            "launches": sum(r["launches"] for r in rows), "floor_s": floor,
            "floor_ratio": step_s / floor if floor > 0 else None,
            "top_gains": [{"site": r["site"], "gain_s": r["gain_s"]}
                          for r in sorted(rows, key=lambda r: -r["gain_s"])[:3]],
            "rows": rows, "note": "; ".join(sorted(notes))}


def check_shape(shapes: Any, batch_size: int, input_len: int) -> None:
    """Raise InputError naming the flag whose value the engine cannot profile: a prompt of `input_len` tokens
    and at least one decode step after it."""
    from trtbuild.errors import InputError
    from trtbuild.recipe import run_shape_problems

    problems = [f"--{field.replace('_', '-')}: {msg}" for field, msg in
                run_shape_problems(shapes, batch_size, input_len, 2) if field != "output_len"]
    if input_len + 2 > shapes.max_seq_len and input_len >= 1:
        problems.append(f"--input-len: {input_len} leaves no room for a decode step (shapes.max_seq_len "
                        f"{shapes.max_seq_len})")
    if problems:
        raise InputError("; ".join(problems))


# -- collecting ----------------------------------------------------------------------------------------------
def _step(own_s: float, walls: list[float], cuda: bool) -> tuple[float, float]:
    """(the step the rows are shares of, the profiled wall time). On a GPU, the engine's own step, unprofiled:
    the profiler's tracing adds time between the kernels of a replayed graph (a 1B decode step on an H100,
    2026-12-06: 1.217 ms profiled against 1.101 ms, ~0.9 us for each of its 135 kernels), while each kernel's
    duration is the device's own timestamps; "between kernels" is then the step less its kernels. On the
    CPU the profiled step is the eager replay of the graph's operators, so the rows are shares of that."""
    profiled = statistics.fmean(walls)
    return (own_s if cuda else profiled), profiled


def _collect(fn: Any, reps: int, device: str) -> tuple[list[list[Op]], list[float], str]:
    """Run `fn` `reps` times under torch.profiler: the ops of each run, in order, each run's wall time, and a
    note where the runs could not be told apart."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from trtbuild.timing import StepClock, sync

    cuda = device.startswith("cuda")
    if not cuda:  # kineto's lines at every profiler start and stop, on stderr; on a GPU its CUPTI warnings matter
        os.environ.setdefault("KINETO_LOG_LEVEL", "99")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    clock = StepClock(device)
    sync(device)
    with profile(activities=activities) as prof, torch.no_grad():
        clock.mark()
        for _ in range(reps):
            with record_function(_MARK):
                fn()
            clock.mark()
        sync(device)
    walls = clock.intervals()
    runs, note = runs_of(list(prof.events()), reps, cuda)
    return runs, walls if len(runs) == reps else [sum(walls)], note


def runs_of(events: list[Any], reps: int, cuda: bool) -> tuple[list[list[Op]], str]:
    """The ops of each of `reps` runs in a profile's events, and a note where the runs could not be told apart.
    On a GPU its kernels in start order, split evenly (a kernel inside a graph replay has no host parent to
    tell its run by); where they do not split evenly, all runs as one. On the CPU the top-level operators under
    each run's mark."""
    from torch.autograd import DeviceType

    if cuda:
        # The step's own mark shows on the device too (a user annotation spanning the whole step, measured on
        # an H100 on 2026-12-06): it is no kernel, and counted as one it took the step and left 0 µs to the rest.
        kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA and not _annotation(e)),
                         key=lambda e: e.time_range.start)
        # Under programmatic dependent launch a kernel starts before the one before it ends and waits for it:
        # that wait is its predecessor's time. Each kernel gets the time from the later of its start and the
        # end of every kernel before it, to its end; the kernels' times then add up to the time the device was
        # busy, and the step's rest is time with no kernel running.
        ops, done = [], float("-inf")
        for e in kernels:
            start, end = e.time_range.start, e.time_range.start + e.time_range.elapsed_us()
            ops.append(Op(e.name, max(0.0, end - max(start, done))))
            done = max(done, end)
        per, rest = divmod(len(ops), reps)
        if rest:
            return [ops], f"{len(ops)} kernels in {reps} runs, not the same each run: the table is of all runs as one"
        return [ops[i * per:(i + 1) * per] for i in range(reps)], ""
    marks = sorted((e for e in events if e.name == _MARK), key=lambda e: e.time_range.start)
    return [[Op(c.name, c.time_range.elapsed_us()) for c in sorted(m.cpu_children, key=lambda c: c.time_range.start)]
            for m in marks], ""


def _annotation(event: Any) -> bool:
    """Whether a device-side profiler event is a range a `record_function` marked, not work of the device."""
    return event.name == _MARK or bool(getattr(event, "is_user_annotation", False))


def _noted(phase: dict[str, Any], note: str) -> dict[str, Any]:
    return phase | {"note": "; ".join(n for n in (phase["note"], note) if n)}


class _EagerRunner:
    """Stands in for a compiled graph's AOTInductor runner: `run(inputs)` returns the flat outputs of the
    module the graph was exported from, run eagerly."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def run(self, inputs: list[Any]) -> list[Any]:
        out = self.module(*inputs)
        return list(out) if isinstance(out, tuple | list) else [out]


def _eager_runners(engine: Any, shapes: Any) -> dict[str, _EagerRunner]:
    """An eager runner per compiled graph of a CPU engine, over one model holding the engine's weights."""
    from trtbuild.backends.torch.export import place_model
    from trtbuild.models.llama import Step

    weights = {k.removeprefix("model."): v for k, v in engine._consts.items()}
    dtype = weights["tok_embeddings.weight"].dtype
    model = place_model(engine.cfg, shapes, dtype, engine.device, weights)  # new caches; the norms as stored
    # a prefill that runs through the step program (export.shared_step) hands it a decode step's inputs
    return {name: _EagerRunner(Step(model, from_start=name == "prefill" and not engine.spec["graphs"].get(name, {}).get("step")))
            for name in engine._packages}


def profile_engine(session: Any, phases: tuple[str, ...], batch_size: int, input_len: int,
                   ceilings: dict[str, Any]) -> dict[str, Any]:
    """Profile an open session's engine (the torch backend): for each phase, the engine's own step time as
    `run` measures it and the table of its kernels (CPU: its operators, replayed eagerly)."""
    import torch

    from trtbuild.errors import TrtbuildError

    engine = session.engine
    if not hasattr(engine, "_decoder") or not hasattr(engine, "_packages"):
        raise TrtbuildError(f"backend '{session.recipe.backend}': `trtbuild profile` profiles torch engines only",
                            hint="profile a recipe with `backend: torch`")
    cfg, device = engine.cfg, engine.device
    bucket = engine.bucket_for(batch_size)
    steps = max(1, min(STEPS, engine.spec["max_seq_len"] - input_len - 1))
    prompts = [[(7 * i + r) % cfg.vocab_size for i in range(input_len)] for r in range(batch_size)]
    elem = engine._consts["model.tok_embeddings.weight"].element_size()
    stored = stored_weight_bytes({k.removeprefix("model."): v for k, v in engine._consts.items()})
    session.warmup(batch_size, input_len, steps + 1)
    # as `run` times it, unprofiled: medians over dozens of steps, robust to a stray slow one (a busy CPU)
    new = max(steps + 1, min(33, engine.spec["max_seq_len"] - input_len))
    timed = [engine.generate(prompts, new) for _ in range(2)]
    cuda = device.startswith("cuda")
    result: dict[str, Any] = {"recipe": session.recipe.name, "backend": session.recipe.backend, "device": device,
                              "engine": {"key": session.outcome.key, "path": str(session.outcome.entry.path)},
                              "ceilings": ceilings, "method": METHOD["cuda" if cuda else "cpu"], "phases": {}}
    swapped: dict[str, Any] = {}
    if not cuda:
        for name, runner in _eager_runners(engine, session.recipe.shapes).items():
            swapped[name] = engine._packages[name].runner
            engine._packages[name].runner = runner
    try:
        if "prefill" in phases:
            runs, walls, note = _collect(lambda: engine.generate(prompts, 1), PREFILLS, device)
            sites = call_sites(cfg, bucket, input_len, 0, elem, stored)
            own = statistics.median(g.prefill_s for g in timed)
            step_s, profiled = _step(own, walls, cuda)
            phase = _noted(table(runs, step_s, sites, cfg.num_layers, ceilings, profiled), note)
            result["phases"]["prefill"] = {"batch_size": batch_size, "bucket": bucket, "tokens": input_len,
                                           "runs": len(runs), "engine_step_s": own, **phase}
        if "decode" in phases:
            decoder = engine._decoder(bucket)
            engine.generate(prompts, steps + 1)  # the cache filled to the prompt, the windows captured
            decoder.start(torch.zeros(bucket, dtype=torch.long, device=device), input_len)
            runs, walls, note = _collect(decoder.step, steps, device)
            if cuda and not any(runs):
                # A driver or CUPTI that reports nothing inside graph replays: the same step, its kernels launched
                # one by one from the host (DecodeGraphs.step runs a step eagerly where it has no graph).
                graphs, decoder.graphs = decoder.graphs, {}
                try:
                    decoder.start(torch.zeros(bucket, dtype=torch.long, device=device), input_len)
                    runs, walls, note = _collect(decoder.step, steps, device)
                finally:
                    decoder.graphs = graphs
                eager = ("the profiler saw no kernel inside the CUDA graphs: the step's kernels were launched eagerly "
                         "(no graph, no programmatic launch)")
                note = "; ".join(n for n in (note, eager) if n)
            sites = call_sites(cfg, bucket, 1, input_len + (steps - 1) / 2, elem, stored)
            own = statistics.median(s for g in timed for s in g.decode_step_s)
            step_s, profiled = _step(own, walls, cuda)
            phase = _noted(table(runs, step_s, sites, cfg.num_layers, ceilings, profiled), note)
            result["phases"]["decode"] = {"batch_size": batch_size, "bucket": bucket, "prompt_len": input_len,
                                          "runs": len(runs), "engine_step_s": own, **phase}
    finally:
        for name, runner in swapped.items():
            engine._packages[name].runner = runner
    return result
