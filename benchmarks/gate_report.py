"""The gate's rows, their comparison with a card's baseline, the table and the plot (benchmarks/gate.py runs them).

A row is one figure of the fixed matrix: {"name", "value", "unit", "x_floor", "baseline", "regression", ...}.
Against the baseline of the same card (benchmarks/baselines/<h100|h200>.json) a row is compared by its ratio to
the floor where it has one (lower is better), else by its value in the direction its unit says; more than its
tolerance (3%) worse is a REGRESSION. A row the baseline lacks is new; a row that did not run is not judged;
a row whose step failed, or a correctness row whose check failed, fails the gate as a regression does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

TOLERANCE = 0.03
# A row the host's speed moves (a build's compiling, a server's Python under load) is compared only with a baseline
# measured on a host within this of its speed: a slower host is not a regression of the code (an H100's host
# differs from one lent machine to the next; results/2026-12-07-h100-gate-3/ab/ measured 13f5a34's and a later
# commit's serving level on one machine, both 20% under the baseline's, set on another)
HOST_TOLERANCE = 0.10
HOST_LOOP = 2_000_000
HIGHER = {"tok/s", "x bf16", "prompts", "requests", "x gain", "tests"}  # units where more is better
LOWER = {"ms", "s", "x step floor"}  # units where less is better
NEAR_ONE = {"x TPOT"}  # a ratio that should be 1: its distance from 1 is what is compared


def row(name: str, value: float | None, unit: str, part: int, *, x_floor: float | None = None,
        peer: dict[str, Any] | None = None, tolerance: float = TOLERANCE, context: str = "",
        target: str = "", met: bool | None = None, hard: bool = False, status: str = "ok",
        note: str = "") -> dict[str, Any]:
    """One row. `peer`: torch.compile's figure on the same row ({"name", "value", "x_floor"}); `context`: what a
    figure depends on besides the code (a build's seeds), compared only with a baseline of the same context;
    `target`/`met`: a limit the row is checked against (`hard`: a failed check fails the gate); `status`: ok,
    'not run' (with the reason in `note`) or 'error'."""
    if unit not in HIGHER | LOWER | NEAR_ONE:
        raise ValueError(f"row {name!r}: unit {unit!r} has no direction")
    out: dict[str, Any] = {"name": name, "value": value, "unit": unit, "x_floor": x_floor, "part": part,
                           "status": status, "tolerance": tolerance}
    for key, v in (("peer", peer), ("context", context), ("target", target), ("met", met), ("note", note)):
        if v not in (None, ""):
            out[key] = v
    if hard:
        out["hard"] = True
    if peer and value is not None and peer.get("value") is not None:
        out["behind"] = peer["value"] < value  # the peer took less time on this row
    return out


def host_speed() -> float:
    """Seconds a fixed pure-Python loop takes on this host, the best of three: what a host-bound row's speed is
    judged beside."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        total = 0
        for i in range(HOST_LOOP):
            total += i & 7
        best = min(best, time.perf_counter() - t)
    return best


def _metric(r: dict[str, Any]) -> tuple[str, float | None]:
    """What a row is compared by: its ratio to the floor where it has one, else its value."""
    if r.get("x_floor") is not None:
        return "x_floor", r["x_floor"]
    return "value", r.get("value")


def worse_by(unit: str, compared: str, new: float, old: float) -> float:
    """How much worse `new` is than `old`, as a fraction of `old` (negative: better); for a ratio that should be
    1, the growth of its distance from 1."""
    if compared == "x_floor" or unit in LOWER:
        return new / old - 1
    if unit in HIGHER:
        return 1 - new / old
    return abs(new - 1) - abs(old - 1)


def judge(r: dict[str, Any], base: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`r` with "baseline", "change", "regression" and "verdict" filled in from the baseline rows `base`."""
    r = dict(r)
    compared, mine = _metric(r)
    old = base.get(r["name"])
    r["baseline"] = None
    r["regression"] = False
    if r["status"] == "error":
        r["regression"], r["verdict"] = True, "ERROR"
        return r
    if r["status"] != "ok" or mine is None:
        r["verdict"] = "not run"
        return r
    if r.get("hard") and r.get("met") is False:
        r["regression"], r["verdict"] = True, "FAILED"
        return r
    theirs = old.get(compared) if old else None
    if theirs is None:
        r["verdict"] = "new"
        return r
    r["baseline"] = theirs
    if old.get("context", "") != r.get("context", ""):
        r["verdict"] = f"not compared (baseline {old.get('context') or 'no context'})"
        return r
    mine_host, their_host = r.get("host_s"), old.get("host_s")
    if mine_host and their_host and abs(mine_host / their_host - 1) > HOST_TOLERANCE:
        r["verdict"] = f"not compared (host loop {mine_host:.3f} s, the baseline's {their_host:.3f} s)"
        return r
    r["change"] = worse_by(r["unit"], compared, mine, theirs)
    r["regression"] = r["change"] > r.get("tolerance", TOLERANCE)
    r["verdict"] = "REGRESSION" if r["regression"] else "ok"
    return r


def judge_all(rows: Iterable[dict[str, Any]], baseline: dict[str, Any] | None) -> list[dict[str, Any]]:
    base = {b["name"]: b for b in (baseline or {}).get("rows", [])}
    return [judge(r, base) for r in rows]


def failed(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows that make the gate exit non-zero."""
    return [r for r in rows if r.get("regression")]


def card(device_name: str) -> str | None:
    """The baseline file's card for a device name: h100, h200, or None (no baseline: every row is new)."""
    name = device_name.upper()
    for c in ("H200", "H100"):
        if c in name:
            return c.lower()
    return None


def load_baseline(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def baseline_from(report: dict[str, Any], old: dict[str, Any] | None, why: str) -> dict[str, Any]:
    """A baseline from a run: its measured rows replace those of `old` by name; `old`'s other rows (another part's)
    stay."""
    keep = ("name", "value", "unit", "x_floor", "context", "part", "host_s")
    rows = {b["name"]: b for b in (old or {}).get("rows", [])}
    for r in report["rows"]:
        if r["status"] == "ok" and r.get("value") is not None:
            rows[r["name"]] = {k: r[k] for k in keep if r.get(k) not in (None, "")} | {"commit": report["commit"],
                                                                                    "date": report["date"]}
    return {"device": report["device"], "commit": report["commit"], "date": report["date"], "why": why,
            "rows": list(rows.values())}


# -- the table and the plot -------------------------------------------------------------------------------------------
def _num(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    return f"{x:.3f}" if abs(x) < 100 else f"{x:.1f}"


def table(report: dict[str, Any]) -> str:
    head = ["row", "value", "unit", "x floor", "torch.compile", "baseline", "change", "verdict"]
    lines = [[r["name"], _num(r.get("value")), r["unit"], _num(r.get("x_floor")),
              (f"{_num(r['peer']['value'])} ({_num(r['peer'].get('x_floor'))}x)"
               + (" behind" if r.get("behind") else "")) if r.get("peer") else "-",
              _num(r.get("baseline")), f"{r['change']:+.1%}" if r.get("change") is not None else "-",
              r.get("verdict", "") + (f"; {r['target']}: {'met' if r['met'] else 'NOT MET'}"
                                      if r.get("target") and r.get("met") is not None else "")]
             for r in report["rows"]]
    widths = [max(len(x[i]) for x in [head, *lines]) for i in range(len(head))]
    out = [f"gate: {report['device']}, commit {report['commit']}, {report['date']}, part {report['part']}",
           *("  ".join(c.ljust(w) for c, w in zip(x, widths, strict=True)).rstrip() for x in [head, *lines])]
    for r in report["rows"]:
        if r.get("note"):
            out.append(f"  {r['name']}: {r['note']}")
    behind = [r["name"] for r in report["rows"] if r.get("behind")]
    if behind:
        out.append(f"behind torch.compile on: {', '.join(behind)}")
    bad = failed(report["rows"])
    out.append(f"{len(bad)} row(s) fail the gate: {', '.join(r['name'] for r in bad)}" if bad
               else "no regression")
    return "\n".join(out)


def plot(report: dict[str, Any], path: Path) -> str:
    """Each row with a floor: the engine's ratio, torch.compile's beside it, the baseline's as a tick."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "[gate] matplotlib is not importable here: no plot written (gate.json has every number)"
    rows = [r for r in report["rows"] if r.get("x_floor") is not None]
    if not rows:
        return "[gate] no row with a floor: no plot"
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    ys = list(range(len(rows)))
    ax.barh([y + 0.2 for y in ys], [r["x_floor"] for r in rows], height=0.4, label="trtbuild",
            color=["tab:red" if r.get("regression") else "tab:blue" for r in rows])
    peers = [(y, r["peer"]["x_floor"]) for y, r in zip(ys, rows, strict=True)
             if r.get("peer") and r["peer"].get("x_floor") is not None]
    if peers:
        ax.barh([y - 0.2 for y, _ in peers], [x for _, x in peers], height=0.4, label="torch.compile", color="tab:gray")
    based = [(y, r["baseline"]) for y, r in zip(ys, rows, strict=True) if r.get("baseline") is not None]
    if based:
        ax.scatter([x for _, x in based], [y + 0.2 for y, _ in based], marker="|", s=300, color="k", label="baseline")
    ax.axvline(1.0, color="k", linestyle="--", linewidth=0.8)
    ax.set_yticks(ys, [r["name"] for r in rows])
    ax.invert_yaxis()
    ax.set(xlabel="time / floor (1 = the floor measured in the same run)",
           title=f"gate: {report['device']}, {report['commit']}, {report['date']}")
    ax.legend(fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"[gate] plot written: {path}"
