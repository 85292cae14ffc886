"""The GPU gate's judgement (benchmarks/gate_report.py): every row against the card's baseline, 3% worse in its own
direction is a regression, a missing baseline row is new, a failed step or check fails the gate; and the
bf16 tie rule of the SmolLM2 greedy row (benchmarks/greedy_match.py). Nothing is built here but in the smoke run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gate  # noqa: E402
import gate_report as gr  # noqa: E402
import greedy_match  # noqa: E402


def _base(*rows: dict[str, Any]) -> dict[str, Any]:
    return {"device": "NVIDIA H100 80GB HBM3", "commit": "abc", "date": "2026-12-06", "rows": list(rows)}


def _judge(r: dict[str, Any], *base: dict[str, Any]) -> dict[str, Any]:
    return gr.judge_all([r], _base(*base))[0]


def test_a_ratio_to_the_floor_is_compared_not_the_time() -> None:
    # the time moved 10% but the floor with it (another card's clocks): the ratio is what counts
    base = {"name": "1B bf16 decode b1", "value": 1.0, "unit": "ms", "x_floor": 1.30}
    assert _judge(gr.row("1B bf16 decode b1", 1.1, "ms", 1, x_floor=1.30), base)["verdict"] == "ok"
    r = _judge(gr.row("1B bf16 decode b1", 1.0, "ms", 1, x_floor=1.35), base)
    assert r["regression"] and r["verdict"] == "REGRESSION" and r["baseline"] == 1.30
    assert r["change"] == pytest.approx(1.35 / 1.30 - 1)


@pytest.mark.parametrize(("unit", "old", "new", "regression"), [
    ("ms", 10.0, 10.29, False),  # 2.9% slower: within the tolerance
    ("ms", 10.0, 10.31, True),  # 3.1% slower
    ("ms", 10.0, 5.0, False),  # faster is never a regression
    ("s", 100.0, 103.5, True),
    ("tok/s", 1000.0, 971.0, False),  # 2.9% fewer tokens
    ("tok/s", 1000.0, 969.0, True),  # 3.1% fewer
    ("tok/s", 1000.0, 2000.0, False),
    ("x bf16", 0.60, 0.58, True),
    ("prompts", 4, 3, True),  # one prompt of four no longer equal
    ("x TPOT", 1.02, 1.04, False),  # 2 points further from 1
    ("x TPOT", 1.02, 1.06, True),  # 4 points further
    ("x TPOT", 1.06, 0.98, False),  # closer to 1 from the other side
])
def test_three_percent_worse_in_the_units_own_direction(unit: str, old: float, new: float, regression: bool) -> None:
    r = _judge(gr.row("r", new, unit, 1), {"name": "r", "value": old, "unit": unit})
    assert r["regression"] is regression
    assert r["verdict"] == ("REGRESSION" if regression else "ok")


def test_missing_rows_not_run_rows_and_failures() -> None:
    assert _judge(gr.row("new row", 1.0, "ms", 1))["verdict"] == "new"
    assert not _judge(gr.row("new row", 1.0, "ms", 1))["regression"]
    skipped = _judge(gr.row("r", None, "ms", 2, status="not run", note="no SmolLM2 pieces"),
                     {"name": "r", "value": 1.0, "unit": "ms"})
    assert skipped["verdict"] == "not run" and not skipped["regression"]
    broken = _judge(gr.row("r", None, "ms", 1, status="error", note="Traceback"))
    assert broken["verdict"] == "ERROR" and broken["regression"]
    # a correctness row fails on its own check, baseline or not; a soft target only says NOT MET
    assert _judge(gr.row("greedy", 3, "prompts", 2, target="all 4 equal", met=False, hard=True))["regression"]
    soft = _judge(gr.row("profile", 1.07, "x TPOT", 1, target="within 5%", met=False))
    assert soft["verdict"] == "new" and not soft["regression"]


def test_builds_compare_only_with_a_baseline_of_the_same_seeding_and_at_their_own_tolerance() -> None:
    base = {"name": "build 1B bf16", "value": 60.0, "unit": "s", "context": "seeded"}
    cold = _judge(gr.row("build 1B bf16", 208.0, "s", 1, tolerance=0.25, context="cold"), base)
    assert cold["verdict"].startswith("not compared") and not cold["regression"]
    assert _judge(gr.row("build 1B bf16", 70.0, "s", 1, tolerance=0.25, context="seeded"), base)["verdict"] == "ok"
    assert _judge(gr.row("build 1B bf16", 80.0, "s", 1, tolerance=0.25, context="seeded"), base)["regression"]


def test_a_host_bound_row_is_compared_only_beside_a_baseline_of_a_host_as_fast() -> None:
    """A server's tok/s measured on a host 30% slower than the baseline's is not judged (nor a regression); within
    10% of its speed, or where either side lacks the host's figure, it is compared as any row."""
    base = {"name": "1B paged serve 64 clients output tok/s", "value": 10_000.0, "unit": "tok/s", "host_s": 0.10}
    name = base["name"]
    slower = _judge(gr.row(name, 8_000.0, "tok/s", 3) | {"host_s": 0.13}, base)
    assert slower["verdict"].startswith("not compared (host loop 0.130 s") and not slower["regression"]
    assert _judge(gr.row(name, 8_000.0, "tok/s", 3) | {"host_s": 0.105}, base)["regression"]
    assert _judge(gr.row(name, 8_000.0, "tok/s", 3), base)["regression"]
    assert _judge(gr.row(name, 9_900.0, "tok/s", 3) | {"host_s": 0.105}, base)["verdict"] == "ok"
    report = {"device": "NVIDIA H100", "commit": "new", "date": "2026-12-07",
              "rows": [gr.row(name, 8_000.0, "tok/s", 3) | {"host_s": 0.13, "status": "ok"}]}
    assert gr.baseline_from(report, None, "why")["rows"][0]["host_s"] == 0.13


def test_the_gate_gives_the_host_s_speed_to_the_host_bound_steps_rows_alone(tmp_path: Path) -> None:
    args = gate.parse(["--cpu-smoke", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                            "--engines", str(tmp_path / "engines")])
    g = gate.Gate(args)
    g.report = {"part": "all", "rows": [], "host_s": 0.2}
    g.host_bound = "serve_paged" in gate.HOST_BOUND
    g.add(gr.row("served", 1.0, "tok/s", 3))
    g.host_bound = "paged_probe" in gate.HOST_BOUND
    g.add(gr.row("probed", 1.0, "ms", 3))
    rows = {r["name"]: r for r in g.report["rows"]}
    assert rows["served"]["host_s"] == 0.2 and "host_s" not in rows["probed"]
    assert 0 < gr.host_speed() < 5


def test_behind_torch_compile_is_flagged_per_row() -> None:
    ahead = gr.row("prefill 1024", 4.4, "ms", 1, x_floor=1.7, peer={"name": "torch.compile", "value": 5.0})
    behind = gr.row("prefill 128", 5.8, "ms", 1, x_floor=7.0, peer={"name": "torch.compile", "value": 4.0})
    assert not ahead["behind"] and behind["behind"]
    report = {"device": "H100", "commit": "abc", "date": "d", "part": "1", "rows": gr.judge_all([ahead, behind], None)}
    text = gr.table(report)
    assert "behind torch.compile on: prefill 128" in text and "no regression" in text


def test_units_without_a_direction_are_refused() -> None:
    with pytest.raises(ValueError, match="no direction"):
        gr.row("r", 1.0, "furlongs", 1)


def test_cards_and_baselines() -> None:
    assert gr.card("NVIDIA H100 80GB HBM3") == "h100" and gr.card("NVIDIA H200") == "h200"
    assert gr.card("cpu") is None
    report = {"device": "NVIDIA H100", "commit": "new", "date": "2026-12-07",
              "rows": [gr.row("a", 2.0, "ms", 1, x_floor=1.2), gr.row("b", None, "ms", 1, status="not run")]}
    old = _base({"name": "a", "value": 1.0, "unit": "ms"}, {"name": "c", "value": 5.0, "unit": "tok/s", "part": 2})
    new = gr.baseline_from(report, old, "the prefill attention changed")
    rows = {r["name"]: r for r in new["rows"]}
    assert rows["a"]["value"] == 2.0 and rows["a"]["x_floor"] == 1.2 and rows["a"]["commit"] == "new"
    assert rows["c"]["value"] == 5.0  # part 2's row, not in this run, kept
    assert "b" not in rows and new["why"] == "the prefill attention changed"


@pytest.mark.parametrize(("engine", "ref", "top2", "equal", "matched"), [
    ([5, 6, 7], [5, 6, 7], [(10.0, 1.0)] * 3, True, 3),
    ([5, 6, 8], [5, 6, 7], [(10.0, 1.0), (10.0, 1.0), (17.0, 16.8)], True, 2),  # 0.2 <= 4 spacings of 0.125
    ([5, 6, 8], [5, 6, 7], [(10.0, 1.0), (10.0, 1.0), (17.0, 16.0)], False, 2),  # a clear choice, not a tie
    ([5, 9], [5, 6, 7], [(10.0, 1.0)] * 3, False, 1),
    ([5, 6], [5, 6, 7], [(10.0, 1.0)] * 3, True, 2),  # the engine stopped (EOS) where the reference went on
])
def test_greedy_texts_are_equal_up_to_the_first_bf16_tie(engine: list[int], ref: list[int],
                                                          top2: list[tuple[float, float]], equal: bool,
                                                          matched: int) -> None:
    got = greedy_match.match(engine, ref, top2)
    assert got["equal"] is equal and got["matched"] == matched


def test_bf16_spacing() -> None:
    assert greedy_match.bf16_spacing(1.0) == 2 ** -7
    assert greedy_match.bf16_spacing(17.0) == 0.125
    assert greedy_match.bf16_spacing(-3.0) == 2 ** -6


def test_the_plan_fits_each_part_into_one_call() -> None:
    for part in ("1", "2", "3"):
        steps = [gate.STEPS[k] for k in gate.steps_to_run(part, None)]
        assert steps and gate.STARTUP_S + sum(s.cold_s for s in steps) < 570, part
    assert gate.steps_to_run("3", None) == ["serve_paged", "paged_probe", "smollm2"] and gate.steps_to_run("2", None)[-1] == "bench_quant"
    assert set(gate.ALL_ORDER) == set(gate.STEPS) == set(gate.RUNNERS)
    assert "total" in gate.plan_text(seeded=False)


def test_the_exit_status_follows_the_rows(tmp_path: Path) -> None:
    """--plan runs nothing; a gate whose rows hold a regression exits 1 (the table says which)."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gate.py"), "--plan"], capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 0 and "part" in proc.stdout
    rows = gr.judge_all([gr.row("a", 2.0, "ms", 1, x_floor=2.0)], _base({"name": "a", "value": 1.0, "unit": "ms",
                                                                       "x_floor": 1.0}))
    assert [r["name"] for r in gr.failed(rows)] == ["a"]


@pytest.mark.slow
def test_cpu_smoke_run(tmp_path: Path) -> None:
    """The whole plumbing on the CPU: tiny engines built, every step's rows written, the table printed."""
    base = tmp_path / "baseline.json"
    args = [sys.executable, str(ROOT / "benchmarks" / "gate.py"), "--cpu-smoke", "--out", str(tmp_path / "out"),
            "--work", str(tmp_path / "work"), "--engines", str(tmp_path / "e"), "--budget", "1500",
            "--baseline", str(base), "--write-baseline", "smoke"]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "gate.json").read_text())
    names = {r["name"]: r for r in report["rows"]}
    assert names["tiny bf16 decode b1"]["x_floor"] > 0 and names["tiny fp8 decode b1 tok/s vs bf16"]["value"] > 0
    assert names["tiny serve 4 streams output tok/s"]["value"] > 0
    assert names["tiny paged serve 4 clients output tok/s"]["value"] > 0
    assert names["tiny paged decode step 4 rows"]["x_floor"] > 0 and names["tiny paged prompt chunk 32 after 16"]["value"] > 0
    assert names["tiny paged mixed step, 4 decode rows and a 16-token chunk"]["value"] > 0
    assert names["tiny paged serve shared prefix 4 clients: TTFT p50 gain from the prefix cache"]["value"] > 0
    assert names["SmolLM2-135M bf16 greedy = transformers"]["verdict"] == "not run"
    assert (tmp_path / "out" / "details.tar.gz").is_file() and base.is_file()


def test_only_runs_the_named_steps_in_the_order_every_step_runs() -> None:
    """--only reruns the rows one change can move, in the gate's own order; an unknown step is one line."""
    assert gate.steps_to_run("2", "bench_quant,build_int4,build_bf16") == ["build_bf16", "build_int4", "bench_quant"]
    assert gate.steps_to_run("1", None) == ["build_bf16", "profile", "bench_bf16"]
    # int4_wo's rows without the fp8 engine: by name only, never in a part (bench_quant has its rows)
    assert gate.steps_to_run("1", "bench_int4,build_int4") == ["build_int4", "bench_int4"]
    assert "bench_int4" not in gate.steps_to_run("all", None)
    with pytest.raises(SystemExit, match="unknown step\\(s\\) build_fp4"):
        gate.steps_to_run("all", "build_fp4")


def test_a_paged_step_is_judged_on_its_kernels_and_its_wall_time_only_past_a_wider_tolerance() -> None:
    """The wall time of a captured decode step moved 14% between two runs of one commit on one H100 while its
    kernels' device time did not: a 12% slower wall with the same kernels passes, 6% slower kernels fail."""
    split = {"kernel_ms": 1.9, "attention_ms": 0.3, "matmul_ms": 1.4, "other_ms": 0.2, "kernels": 214}
    report = {"prefill_graph": [], "chunks": [], "together": None, "mixed": None,
              "decode": [{"rows": 64, "ms": 2.3, "floor_ms": 1.2, "context": 512, "captured": True, "split": split},
                         {"rows": 256, "ms": 4.3, "floor_ms": 2.2, "context": 512, "captured": True, "split": None}]}
    rows = {r["name"]: r for r in gate.paged_rows(report, "1B", 3, tiny=False)}
    wall, kernels = rows["1B paged decode step 64 rows"], rows["1B paged decode step 64 rows, kernels"]
    assert kernels["value"] == 1.9 and abs(kernels["x_floor"] - 1.9 / 1.2) < 1e-9
    assert "1B paged decode step 256 rows, kernels" not in rows  # not profiled: no device time to judge
    assert rows["1B paged prompt chunk 512 after 1024"]["status"] == "not run"
    later = {r["name"]: r for r in gate.paged_rows(
        report | {"decode": [report["decode"][0] | {"ms": 2.3 * 1.12, "split": split | {"kernel_ms": 1.9 * 1.06}}]},
        "1B", 3, tiny=False)}
    assert _judge(later[wall["name"]], wall)["verdict"] == "ok"
    assert _judge(later[kernels["name"]], kernels)["verdict"] == "REGRESSION"


def test_the_gptq_rows_take_each_formats_fastest_way_and_fail_where_a_way_stored_other_numbers() -> None:
    def shape(name: str, fmt: str, ways: dict[str, float], same: bool = True) -> dict[str, Any]:
        return {"model": "8b", "shape": name, "format": fmt, "layers": 32, **{w: {"s": s} for w, s in ways.items()},
                "same_as_eager": {w: same for w in ways if w != "eager"}}

    probe = [shape("qkv", "fp8", {"eager": 1.0, "graphs": 0.2, "kernel": 0.01}),
             shape("down", "fp8", {"eager": 3.0, "graphs": 0.6, "kernel": 0.03}),
             shape("qkv", "int4", {"eager": 1.2, "graphs": 0.3})]
    rows = {r["name"]: r for r in gate.gptq_rows(probe, 0)}
    assert abs(rows["GPTQ fp8 loops, every 8B layer (kernel)"]["value"] - 32 * 0.04) < 1e-9
    assert abs(rows["GPTQ int4 loops, every 8B layer (graphs)"]["value"] - 32 * 0.3) < 1e-9
    assert "eager 38.4 s" in rows["GPTQ int4 loops, every 8B layer (graphs)"]["note"]
    assert _judge(rows["GPTQ's ways store what the eager loop does"])["verdict"] != "FAILED"
    probe[2]["same_as_eager"]["graphs"] = False
    bad = {r["name"]: r for r in gate.gptq_rows(probe, 0)}["GPTQ's ways store what the eager loop does"]
    assert bad["value"] == 2 and _judge(bad)["verdict"] == "FAILED" and "int4" in bad["note"]


def test_the_8b_serving_step_judges_ttft_and_the_time_between_tokens_at_64_clients(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its rows from serve_bench's figures: 0.6 of the floor at 64 clients, 64 running at once, TTFT p50 against
    100 ms, TPOT p99 over the widest decode bucket's floor against 1.5x, and the prefix cache's two gains."""
    def level(tput: float, ttft: float, tpot_p99: float) -> dict[str, Any]:
        return {"requests": 256, "errors": [], "output_tok_per_s": tput, "fraction_of_floor": tput / 5000,
                "ttft_ms": {"p50": ttft, "p99": 4 * ttft}, "tpot_ms": {"p50": tpot_p99 - 0.5, "p99": tpot_p99},
                "peak_running": 64, "preemptions": 0.0, "prefix_hits": 100.0,
                "floor_s": 256 * 128 / 5000, "output_tokens": 256 * 128,
                "decode_steps": {"8": {"mean_ms": 7.0, "floor_ms": 5.0, "mean_rows": 6.0},
                                 "64": {"mean_ms": 8.3, "floor_ms": 6.4, "mean_rows": 60.0}}}

    figs = {"8b-random": {"16": level(1700, 60, 8.8), "64": level(3700, 123, 15.8)},
            "8b-prefix": {"64": level(6100, 70, 9.9)}, "8b-no-prefix": {"64": level(2600, 590, 19.3)}}
    called: list[tuple[str, str, str]] = []

    def fake(g: gate.Gate, key: str, path: str, workload: str, conc: str, flags: str) -> dict[str, Any]:
        called.append((key, path, conc))
        return figs[key]

    monkeypatch.setattr(gate, "paged_serve_bench", fake)
    g = gate.Gate(gate.parse(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                              "--engines", str(tmp_path / "e")]))
    g.report, g.part = {"part": "all", "rows": []}, 0
    gate.serve_8b_step(g)
    assert {c[1] for c in called} == {"recipes/llama-3.1-8b.yaml"} and called[0][2] == "16,64"
    rows = {r["name"]: r for r in g.report["rows"]}
    assert rows["8B paged serve 64 clients output tok/s"]["met"] is True  # 0.74 of the floor
    assert rows["8B paged serve 64 clients: most requests running at once"]["met"] is True
    ttft = rows["8B paged serve 64 clients TTFT p50"]
    assert ttft["value"] == 123 and ttft["met"] is False
    between = rows["8B paged serve 64 clients: TPOT p99 over the decode step's floor"]
    assert between["value"] == pytest.approx(15.8 / 6.4) and between["met"] is False
    # against a step that prefills its share of the prompts too: the floor of 60 of the workload's tokens
    workload = rows["8B paged serve 64 clients: TPOT p99 over the workload's step floor"]
    assert workload["value"] == pytest.approx(15.8 / (60 / 5000 * 1e3)) and workload.get("met") is None
    assert rows["8B paged serve shared prefix 64 clients: output tok/s gain from the prefix cache"]["value"] == \
        pytest.approx(6100 / 2600)
