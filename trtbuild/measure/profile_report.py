"""`trtbuild profile` as people read it: a table of call sites per phase, and a roofline PNG."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from trtbuild.errors import InputError


def _si(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}".rstrip()


def _short(site: str) -> str:
    return site.replace("layers.*.", "").replace(" (rope, cache, QK^T, softmax, PV)", "")


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


def _rate(value: float | None, fraction: float | None, unit: str) -> str:
    return "-" if value is None or fraction is None else f"{_si(value, unit)} ({fraction:.0%})"


def print_profile(result: dict[str, Any]) -> None:
    """Each phase's call sites, slowest first, then the step's time between kernels, floor and best gains."""
    from rich.console import Console
    from rich.table import Table

    console = Console()  # a terminal's own width (or $COLUMNS)
    if not console.is_terminal and "COLUMNS" not in os.environ:  # a pipe or a log: wide enough for ten columns
        console = Console(width=220)
    c = result["ceilings"]
    console.print(f"{result['recipe']} on {result['device']} ({c.get('device_name', '')}): roofs copy "
                  f"{c['copy_Bps'] / 1e9:.1f} GB/s, {c['matmul_dtype']} matmul {c['matmul_flops_per_s'] / 1e12:.3g} "
                  f"TFLOP/s ({c['source']})", highlight=False)
    console.print(f"method: {result['method']}", highlight=False)
    for name, p in result["phases"].items():
        shape = (f"{p['tokens']} tokens" if name == "prefill" else f"after a {p['prompt_len']}-token prompt")
        table = Table(title=f"{name}: batch {p['batch_size']} (bucket {p['bucket']}), {shape}, mean of {p['runs']}",
                      title_justify="left")
        # The call site is what a reader looks for: never cut or wrapped (its column keeps its longest name); the
        # kernel names and verdicts wrap instead when the terminal is narrow.
        longest = max([len(r["site"]) for r in p["rows"]] + [len("between kernels")])
        table.add_column("call site", no_wrap=True, min_width=longest)
        table.add_column("kernel", overflow="fold")
        for col in ("launches", "µs/step", "share", "bytes", "FLOPs", "B/s (of roof)", "FLOP/s (of roof)"):
            table.add_column(col, justify="right")
        table.add_column("verdict", overflow="fold")
        for r in p["rows"]:
            top = r["kernels"][0]["name"] if r["kernels"] else ""
            more = f" +{len(r['kernels']) - 1}" if len(r["kernels"]) > 1 else ""
            table.add_row(r["site"], (top[:40] + "…" if len(top) > 41 else top) + more, f"{r['launches']:g}",
                          _us(r["time_s"]), f"{r['share']:.1%}", _si(r["bytes"], "B"), _si(r["flops"]),
                          _rate(r.get("Bps"), r.get("bw_fraction"), "B/s"),
                          _rate(r.get("flops_per_s"), r.get("flops_fraction"), "FLOP/s"), r["verdict"])
        table.add_row("between kernels", "", "", _us(p["between_s"]), f"{p['between_share']:.1%}", "", "", "", "",
                      "overlap (kernels run side by side)" if p["between_s"] < 0 else "")
        console.print(table)
        # The engine's own step first: it is the figure `run` reports and the one to quote. On a GPU the rows
        # are shares of it (the kernels' own durations); on the CPU, of the profiled step, which replays the
        # graph op by op, eagerly.
        ratio = f"{p['engine_step_s'] / p['floor_s']:.2f}x" if p["floor_s"] else "-"
        profiled = p.get("profiled_step_s", p["step_s"])
        of = "that step" if p["step_s"] == p["engine_step_s"] else f"the profiled step, {_us(p['step_s'])} µs"
        console.print(f"  step {_us(p['engine_step_s'])} µs as `run` times the engine; the rows above share out "
                      f"{of} (kernels {_us(p['kernel_s'])} µs in {p['launches']:g} launches, between kernels "
                      f"{_us(p['between_s'])} µs; {_us(profiled)} µs a step under the profiler)", highlight=False)
        console.print(f"  floor {_us(p['floor_s'])} µs (each call site at its roof): the engine's step is {ratio} "
                      "its floor", highlight=False)
        gains = ", ".join(f"{g['site']} ({_us(g['gain_s'])} µs)" for g in p["top_gains"])
        console.print(f"  most to gain (time minus own floor): {gains}", highlight=False)
        if p["note"]:
            console.print(f"  note: {p['note']}", highlight=False)


def check_plot_path(path: str) -> None:
    """Refuse a --plot that cannot be written before any profiling: a .png, and matplotlib importable."""
    if not path.lower().endswith(".png"):
        raise InputError(f"--plot: {path}: expected a .png file name")
    if not Path(path).absolute().parent.is_dir():
        raise InputError(f"--plot: {path}: its folder does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InputError("--plot: matplotlib is not installed", hint="pip install 'trtbuild[plot]'") from None


def plot(result: dict[str, Any], path: str) -> None:
    """Per phase: a roofline (arithmetic intensity against achieved FLOP/s, one point a modelled call site, the
    copy and matmul roofs drawn) and a bar of where the step's time goes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = list(result["phases"].items())
    c = result["ceilings"]
    bw, rate = c["copy_Bps"], c["matmul_flops_per_s"]
    fig, axes = plt.subplots(len(phases), 2, figsize=(14, 5 * len(phases)), squeeze=False)
    for (name, p), (roof_ax, bar_ax) in zip(phases, axes, strict=True):
        points = [r for r in p["rows"] if r.get("intensity") and r.get("flops_per_s")]
        xs = [r["intensity"] for r in points] + [rate / bw]
        lo, hi = min(xs) / 4, max(xs) * 4
        grid = [lo * (hi / lo) ** (i / 100) for i in range(101)]
        roof_ax.plot(grid, [min(x * bw, rate) for x in grid], "k-", label="roofs (measured copy, matmul)")
        for r in points:
            roof_ax.plot(r["intensity"], r["flops_per_s"], "o")
            roof_ax.annotate(_short(r["site"]), (r["intensity"], r["flops_per_s"]), fontsize=7)
        roof_ax.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="achieved FLOP/s",
                    title=f"{name}: roofline")
        roof_ax.grid(True, which="both", alpha=0.3)
        roof_ax.legend(fontsize=8)
        bars = [(_short(r["site"])[:40], r["time_s"]) for r in p["rows"]]
        bars.append(("between kernels", p["between_s"]))
        bars.sort(key=lambda b: b[1])
        bar_ax.barh([b[0] for b in bars], [b[1] * 1e6 for b in bars])
        bar_ax.set(xlabel="µs per step", title=f"{name}: where the step's {p['step_s'] * 1e6:,.0f} µs go")
        bar_ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(f"{result['recipe']} on {result['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
