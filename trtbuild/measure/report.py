"""The run report as people read it: one row per phase, each with its time and what bounds it."""

from __future__ import annotations

from typing import Any


def print_table(rep: dict[str, Any]) -> None:
    """`trtbuild run`'s report (`runner.run_report`) as a table of phases, then the engine and the outputs."""
    from rich.console import Console
    from rich.table import Table

    e, p, s = rep["engine"], rep["phases"], rep["shape"]
    table = Table(title=f"{rep['recipe']} · {rep['backend']} on {rep['device']} · batch {s['batch_size']}, "
                        f"{s['input_len']} in, {s['output_len']} out", title_justify="left")
    table.add_column("phase")
    table.add_column("time", justify="right")
    table.add_column("note")
    table.add_row("start-up", f"{p.get('startup_s', 0.0) * 1e3:.1f} ms", "import the framework, find the device")
    table.add_row("lookup", f"{p['lookup_s'] * 1e3:.1f} ms", f"key {e['key'][:16]} in {e.get('store') or 'the store'}")
    table.add_row("build", "cached" if e["cache_hit"] else f"{p['build_s']:.1f} s", _build_note(e))
    if (fleet := e.get("fleet") or {}).get("url"):  # the remote tier (store/fleet.py): what it served or took, and when
        seconds = fleet.get("pull_s", 0.0) if fleet.get("tier") == "remote" else fleet.get("push_s", 0.0)
        verb = {"remote": "pulled from", "built": "pushed to"}.get(fleet.get("tier", ""), "not needed:")
        table.add_row("remote", f"{seconds:.2f} s" if fleet.get("tier") in ("remote", "built") else "-",
                      f"{verb} {fleet['url']}" + (f" · {fleet['warning']}" if fleet.get("warning") else ""))
    parts = " · ".join(f"{k.removesuffix('_s')} {v * 1e3:.1f} ms" for k, v in rep.get("load_parts", {}).items())
    table.add_row("load", f"{p['load_s'] * 1e3:.1f} ms", " · ".join(n for n in (parts, rep.get("load_note", "")) if n))
    table.add_row("warm-up", f"{p['warmup_s'] * 1e3:.1f} ms", "excluded from the figures below")
    roof = rep.get("roofline", {})
    # A rate is shown only beside its ceiling: alone ("0.0 GB/s" on a CPU) it says nothing about the engine.
    rates = (_of_peak(roof, "prefill_flops_per_s", "prefill_fraction_of_peak_flops", 1e12, "TFLOP/s"),
             _of_peak(roof, "prefill_bandwidth_Bps", "prefill_fraction_of_peak_bandwidth", 1e9, "GB/s"))
    note = " · ".join(n for n in rates if n)
    if note and "prefill_bound" in roof:
        note += f" · {roof['prefill_bound']}-bound"
    table.add_row("prefill (TTFT)", f"{rep['ttft_ms']:.2f} ms", note)
    if pl := rep.get("prefill_launch"):
        if pl.get("replayed"):
            n = pl.get("lengths") or {}
            padding = (f"{n.get('prompt')} tokens, the graph's own length" if n.get("prompt") == n.get("graph") else
                       f"{n.get('prompt')} tokens padded to {n.get('graph')} rows")
            how = (f"one captured graph, replayed ({padding}; graphs kept: {len(pl.get('shapes', []))}, "
                   f"their captures reserved {pl.get('captures_reserved_mib')} MiB)")
        else:
            how = f"kernel by kernel from the host ({pl.get('why', 'no graph for this length')})"
        table.add_row("  prefill launch", "", how)
    t = rep["tpot_ms"]
    rate = rep["tokens_per_s"]
    note = (f"p90 {t['p90']:.3f} · p99 {t['p99']:.3f} ms · {rate['decode']:.1f} tok/s of decode time, "
            f"{rate['end_to_end']:.1f} tok/s end to end")
    if bw := _of_peak(roof, "decode_bandwidth_Bps", "decode_fraction_of_peak_bandwidth", 1e9, "GB/s"):
        note += f" · {bw}"
    table.add_row("decode (TPOT p50)", f"{t['p50']:.3f} ms", note)
    if mt := rep.get("decode_matmuls_timed"):
        # the build's selection timings, not this run's: they say how much of the step the matmuls alone take
        outside = mt.get("fused_outside") or []
        table.add_row(f"  {mt['graph']} matmuls", f"{mt['ms']:.3f} ms",
                      f"alone, as the build timed them: {mt['ms'] / t['p50']:.0%} of the step; the rest is attention, "
                      "norms and what lies between kernels"
                      + (f"; the fusion of {', '.join(outside)} by Inductor's kernels, outside the matmul (the plan "
                         "timed that faster)" if outside else ""))
    for graph, launch in rep.get("decode_launch", {}).items():
        how = (f"PDL: {launch.get('programmatic_edges', 0)} of {launch.get('kernels', 0)} kernels may start early "
               f"({launch['why']})" if launch.get("on") else f"serialized ({launch.get('why', '')})")
        table.add_row(f"  {graph} launch", "", how)
    if par := rep.get("parallel"):  # tensor parallel: the slowest rank sets each figure above
        for r in [*par["ranks"], {**par["all"], "rank": "all"}]:
            share = (f" ({r['allreduce_ms_per_step'] / r['tpot_ms']:.0%} of TPOT)"
                     if r.get("allreduce_ms_per_step") is not None and r.get("tpot_ms") else "")
            table.add_row(f"  rank {r['rank']}", "", f"load {r['load_s'] * 1e3:.1f} ms · TTFT {_ms(r.get('ttft_ms'))} · "
                          f"TPOT {_ms(r.get('tpot_ms'))} · all-reduce {_ms(r.get('allreduce_ms_per_step'))} a step{share}")
        table.add_row("  all-reduce", "", f"{par['tp']} ranks over {par['backend']}: {par['allreduce_method']}")
    table.add_row("end to end", f"{p['end_to_end_s'] * 1e3:.1f} ms", "per iteration, after warm-up")
    console = Console()
    console.print(table)
    if rep.get("unstable"):
        console.print(f"[bold]unstable:[/bold] TPOT {rep['unstable']}", highlight=False)
    if th := rep.get("threads"):
        console.print(f"threads: {th['threads']} ({th['why']})", highlight=False)
    console.print(f"engine: {e['path']}")
    for i, row in enumerate(rep["output_ids"]):
        console.print(f"output[{i}]: {row}", highlight=False)
    for i, text in enumerate(rep.get("output_text", [])):
        console.print(f"text[{i}]: {text!r}", highlight=False)


def _of_peak(roof: dict[str, Any], rate: str, fraction: str, scale: float, unit: str) -> str:
    """"1.2 TB/s (36.0% of peak)", or "" when the roof has no ceiling for this rate (a CPU, an unknown GPU)."""
    if rate not in roof or fraction not in roof:
        return ""
    digits = 3 if unit == "TFLOP/s" else 1
    return f"{roof[rate] / scale:.{digits}f} {unit} ({roof[fraction]:.1%} of peak)"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} ms"


def _build_note(e: dict[str, Any]) -> str:
    """What the build row means: a hit, a build, or a corrupt entry moved aside and built again."""
    damaged = e.get("quarantined") or []
    if e["cache_hit"] and not damaged:
        return "cache hit: no export, no compile"
    note = "cache hit" if e["cache_hit"] else "built and published"
    if damaged:
        note = f"the entry was corrupt: {'; '.join(damaged)}; " + ("found again" if e["cache_hit"] else "rebuilt")
    reused = e.get("graphs_reused") or []
    if not e["cache_hit"] and reused:
        note += f" ({len(reused)} compiled graph(s) copied from the tactic cache: {', '.join(reused)})"
    return note
