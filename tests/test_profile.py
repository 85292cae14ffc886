"""`trtbuild profile`: call sites' bytes and FLOPs against the model's own, the table's arithmetic, the verdicts,
the cached ceilings, and the command end to end on a tiny CPU engine (one build for the module)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from trtbuild.measure import ceilings
from trtbuild.cli import main
from trtbuild.models.llama import LlamaConfig, Transformer
from trtbuild.measure.profile import (ATTENTION, BEFORE, DOWN, FINAL_NORM, GATE_UP, LM_HEAD, O_PROJ, QKV, Op, attribute,
                              call_sites, runs_of, table, verdict)

from .conftest import TINY_CONFIG, read_json_line, run_cli, tiny_recipe_doc, write_recipe

CEILINGS = {"copy_Bps": 1e12, "matmul_flops_per_s": 1e14, "matmul_dtype": "bfloat16", "source": "test"}
LINEARS = {QKV: "attention.wqkv", O_PROJ: "attention.wo", GATE_UP: "feed_forward.w13", DOWN: "feed_forward.w2"}


def _counted(model: Transformer, tokens: torch.Tensor, pos: torch.Tensor, **kw: Any) -> tuple[dict[str, float],
                                                                                                 dict[str, float]]:
    """FLOPs (torch's FlopCounterMode) and bytes (each Linear's weight, input and matmul output, seen by hooks) of
    one forward, per call site, all layers together."""
    from torch.utils.flop_counter import FlopCounterMode

    seen: dict[str, float] = {}

    def hook(name: str) -> Any:
        def record(module: Any, args: tuple[Any, ...], out: Any) -> None:
            rows = args[0].numel() // module.in_features
            elem = module.weight.element_size()
            seen[name] = seen.get(name, 0.0) + elem * (module.weight.numel() + rows * (module.in_features
                                                                                      + module.out_features))
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(tokens, pos, **kw)
    for h in handles:
        h.remove()
    counts = {k: float(sum(v.values())) for k, v in counter.get_flop_counts().items()}
    flops = {site: sum(counts[f"Transformer.layers.{i}.{lin}"] for i in range(2)) for site, lin in LINEARS.items()}
    flops[LM_HEAD] = counts["Transformer.output"]
    flops["attention bmm"] = sum(counts.get(f"Transformer.layers.{i}.attention", 0.0) for i in range(2)) - sum(
        counts[f"Transformer.layers.{i}.attention.{x}"] for i in range(2) for x in ("wqkv", "wo"))
    moved = {site: sum(seen[f"layers.{i}.{lin}"] for i in range(2)) for site, lin in LINEARS.items()}
    moved[LM_HEAD] = seen["output"]
    return flops, moved


def test_call_sites_bytes_and_flops_are_the_models_own() -> None:
    """A prefill of 5 tokens and a decode step at position 9, batch 2: each matmul's FLOPs as torch counts them
    and its bytes from the modules' own tensors; the decode attention's FLOPs as the two cache matmuls count."""
    cfg = LlamaConfig.from_hf(TINY_CONFIG)
    torch.manual_seed(0)
    model = Transformer(cfg, 2, 48, torch.float32).eval()
    flops, moved = _counted(model, torch.zeros(2, 5, dtype=torch.long), torch.arange(5), from_start=True)
    sites = call_sites(cfg, 2, 5, 0, 4)
    for site in (*LINEARS, LM_HEAD):
        assert sites[site].flops == flops[site], site
        assert sites[site].bytes == moved[site], site
    # the causal prompt attention: QK^T and PV over the keys each row sees (1 + 2 + ... + 5), 4 heads of 8
    assert sites[ATTENTION].flops == 2 * 2 * 2 * 2 * 4 * 8 * (1 + 2 + 3 + 4 + 5)
    # q read + out written (5 rows x 32), k and v read (5 x 16 each) and written to the cache, per row and layer
    assert sites[ATTENTION].bytes == 2 * 4 * 2 * (5 * 32 * 2 + 5 * 16 * 2 + 5 * 16 * 2)

    # decode at position 9 over exactly the 10 filled slots: the cache matmuls' FLOPs are the attention's
    flops, moved = _counted(model, torch.zeros(2, 1, dtype=torch.long), torch.tensor([9]), span=torch.arange(10))
    sites = call_sites(cfg, 2, 1, 9, 4)
    for site in (*LINEARS, LM_HEAD):
        assert (sites[site].flops, sites[site].bytes) == (flops[site], moved[site]), site
    assert sites[ATTENTION].flops == flops["attention bmm"] == 2 * 2 * 2 * 2 * 4 * 8 * 10
    assert sites[ATTENTION].bytes == 2 * 4 * 2 * (32 * 2 + 10 * 16 * 2 + 16 * 2)


def _layer(attention: list[str], between: dict[str, list[str]] | None = None) -> list[str]:
    b = between or {}
    return ["gemv_qkv", *attention, "gemv_o", *b.get("o", []), "gemv_gu", *b.get("gu", []), "gemv_down",
            *b.get("down", [])]


def test_attribute_names_kernels_by_their_place_between_the_matmuls() -> None:
    names = (["embed", "norm0"] + _layer(["rope_cache", "flash_fwd_kernel"], {"o": ["addnorm"], "down": ["norm1"]})
             + _layer(["rope_cache", "flash_fwd_kernel"], {"o": ["addnorm"], "down": ["final"]})
             + ["gemv_head", "_split_reduce_kernel", "argmax"])
    pairs, note = attribute([Op(n, 1.0) for n in names], 2)
    assert note == ""
    got = [(site, op.name) for site, op in pairs]
    assert got[:7] == [(BEFORE, "embed"), (BEFORE, "norm0"), (QKV, "gemv_qkv"), (ATTENTION, "rope_cache"),
                       (ATTENTION, "flash_fwd_kernel"), (O_PROJ, "gemv_o"), ("layers.* residual + ffn_norm", "addnorm")]
    assert (DOWN, "gemv_down") in got and ("layers.* residual + attention_norm", "norm1") in got
    assert got[-5:] == [(DOWN, "gemv_down"), (FINAL_NORM, "final"), (LM_HEAD, "gemv_head"),
                        (LM_HEAD, "_split_reduce_kernel"), ("greedy token + step bookkeeping", "argmax")]
    # matmuls inside the attention (cuBLAS bmm of QK^T and PV): six a layer, the middle two the attention's
    pairs, note = attribute([Op(n, 1.0) for n in _layer(["bmm_gemm", "softmax", "bmm_gemm"]) * 2 + ["gemv_head"]], 2)
    assert note == "" and [s for s, op in pairs if op.name == "bmm_gemm"] == [ATTENTION] * 4
    # a sequence that is not the model's: every kernel keeps its own name, and the note says why
    pairs, note = attribute([Op("gemv", 1.0)] * 4, 2)
    assert "not matched" in note and {s for s, _ in pairs} == {"kernel gemv"}


def test_attribute_knows_the_kernel_names_of_a_cuda_decode_step() -> None:
    """Kernel names as torch.profiler reported an 8B decode step's on an H200 (cuBLAS, trtbuild's Triton kernels,
    Inductor's fused kernels, a cuBLASLt split-K reduction), in a layer's order."""
    norm = "triton_red_fused__to_copy__unsafe_view_add_mean_mul_pow_rsqrt_view_8"
    layer = [norm, "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT", "_decode_attention_partial", "_decode_attention_merge",
             "_decode_matmul_kernel", norm, "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_splitK_TNT",
             "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>(...)",
             "triton_poi_fused__unsafe_view_mul_silu_split_2", "_decode_matmul_kernel"]
    tail = ["triton_red_fused__to_copy__unsafe_view_add_mean_mul_pow_rsqrt_select_9", "_decode_matmul_kernel",
            "triton_red_fused_constant_pad_nd_max_view_10", "triton_per_fused_add_argmax_gather_mul_11",
            "void at::native::index_elementwise_kernel<128, 4, at::native::index_copy_kernel_impl<...> >(...)",
            "Memcpy DtoD (Device -> Device)"]
    pairs, note = attribute([Op(n, 1.0) for n in layer * 2 + tail], 2)
    assert note == ""
    sites = [site for site, _ in pairs]
    assert sites[:10] == [BEFORE, QKV, ATTENTION, ATTENTION, O_PROJ, "layers.* residual + ffn_norm", GATE_UP, GATE_UP,
                          "layers.* silu(gate) * up", DOWN]
    assert sites[10] == "layers.* residual + attention_norm" and sites[19] == DOWN
    assert sites[20:] == [FINAL_NORM, LM_HEAD] + ["greedy token + step bookkeeping"] * 4


def test_verdicts_follow_the_nearer_roof() -> None:
    # 1 MB in 2 us at a 1 TB/s roof: 50% of the copy rate, the FLOPs negligible -> memory-bound
    v = verdict(1e6, 1e6, 2e-6, CEILINGS)
    assert v["floor_s"] == pytest.approx(1e-6) and v["bw_fraction"] == pytest.approx(0.5)
    assert v["verdict"] == "memory-bound"
    # 1 GFLOP of 1 MB in 15 us at 100 TFLOP/s: a 10 us floor from the FLOPs -> compute-bound
    v = verdict(1e6, 1e9, 15e-6, CEILINGS)
    assert v["floor_s"] == pytest.approx(1e-5) and v["verdict"] == "compute-bound"
    assert v["intensity"] == pytest.approx(1000.0)
    # the same work taking 10x its floor: near neither roof
    assert verdict(1e6, 1e6, 20e-6, CEILINGS)["verdict"] == "latency-bound"


def test_the_table_sums_to_the_step() -> None:
    """Two steps of a known sequence: per-step means, shares of the step, the time between kernels, the floor
    and the three largest gains."""
    cfg = LlamaConfig.from_hf(TINY_CONFIG)
    us = {"gemv_qkv": 3.0, "attn": 5.0, "gemv_o": 2.0, "gemv_gu": 4.0, "gemv_down": 3.0, "gemv_head": 6.0,
          "argmax": 1.0}
    names = _layer(["attn"]) * 2 + ["gemv_head", "argmax"]
    steps = [[Op(n, us[n]) for n in names], [Op(n, us[n] * 1.5) for n in names]]
    sites = call_sites(cfg, 1, 1, 7, 4)
    t = table(steps, 60e-6, sites, 2, CEILINGS)
    rows = {r["site"]: r for r in t["rows"]}
    assert rows[QKV]["time_s"] == pytest.approx(2 * 3.0 * 1.25e-6) and rows[QKV]["launches"] == 2
    assert rows[LM_HEAD]["time_s"] == pytest.approx(7.5e-6) and rows[LM_HEAD]["launches"] == 1
    assert rows[QKV]["bytes"] == sites[QKV].bytes and rows[QKV]["Bps"] == pytest.approx(sites[QKV].bytes / 7.5e-6)
    assert t["kernel_s"] == pytest.approx(sum(us[n] for n in names) * 1.25e-6)
    assert t["launches"] == len(names)
    assert sum(r["share"] for r in t["rows"]) + t["between_share"] == pytest.approx(1.0, abs=1e-12)
    assert t["between_s"] == pytest.approx(60e-6 - t["kernel_s"])
    assert [r["time_s"] for r in t["rows"]] == sorted((r["time_s"] for r in t["rows"]), reverse=True)
    floor = sum(max(s.bytes / 1e12, s.flops / 1e14) for s in sites.values())
    assert t["floor_s"] == pytest.approx(floor) and t["floor_ratio"] == pytest.approx(60e-6 / floor)
    gains = sorted(((r["time_s"] - r["floor_s"], r["site"]) for r in t["rows"]), reverse=True)[:3]
    assert [g["site"] for g in t["top_gains"]] == [s for _, s in gains]
    assert rows["greedy token + step bookkeeping"]["verdict"] == "unmodelled"


def test_on_a_gpu_the_rows_share_out_the_engines_own_step_and_the_profiled_wall_is_kept_beside() -> None:
    """A GPU profile's step is the engine's own, unprofiled (the profiler slows a graph replay between its
    kernels, not the kernels): between kernels is that step less the kernels; the profiled wall stays in the
    record. On the CPU the profiled (eager) step is the one shared out."""
    from trtbuild.measure.profile import _step

    cfg = LlamaConfig.from_hf(TINY_CONFIG)
    names = _layer(["attn"]) * 2 + ["gemv_head", "argmax"]
    steps = [[Op(n, 2.0) for n in names]]
    assert _step(50e-6, [60e-6, 62e-6], cuda=True) == (50e-6, pytest.approx(61e-6))
    assert _step(50e-6, [60e-6, 62e-6], cuda=False) == (pytest.approx(61e-6), pytest.approx(61e-6))
    step_s, profiled = _step(50e-6, [60e-6, 62e-6], cuda=True)
    t = table(steps, step_s, call_sites(cfg, 1, 1, 7, 4), 2, CEILINGS, profiled)
    assert t["step_s"] == 50e-6 and t["profiled_step_s"] == pytest.approx(61e-6)
    assert t["between_s"] == pytest.approx(50e-6 - len(names) * 2e-6)
    assert sum(r["share"] for r in t["rows"]) + t["between_share"] == pytest.approx(1.0, abs=1e-12)


def test_gpu_kernels_split_into_runs_by_their_order() -> None:
    """Kernels replayed inside a CUDA graph have no host parent: the runs are told apart by count, in start
    order; a count that does not divide is one run of everything, said in the note."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def kernel(name: str, start: float, us: float, device: Any = DeviceType.CUDA) -> Any:
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(start=start, elapsed_us=lambda: us))

    events = [kernel("b", 20, 2.0), kernel("a", 10, 1.0), kernel("host", 5, 9.0, DeviceType.CPU),
              kernel("d", 40, 4.0), kernel("c", 30, 3.0)]
    runs, note = runs_of(events, 2, cuda=True)
    assert note == "" and runs == [[Op("a", 1.0), Op("b", 2.0)], [Op("c", 3.0), Op("d", 4.0)]]
    runs, note = runs_of(events[:3], 2, cuda=True)  # the host's event is no kernel
    assert note == "" and runs == [[Op("a", 1.0)], [Op("b", 2.0)]]
    runs, note = runs_of(events + [kernel("e", 50, 5.0)], 2, cuda=True)
    assert len(runs) == 1 and len(runs[0]) == 5 and "not the same each run" in note
    # launched early (PDL): b starts at 10.5 while a runs until 11 and ends at 13; c lies inside b
    overlapping = [kernel("a", 10, 1.0), kernel("b", 10.5, 2.5), kernel("c", 11, 1.0), kernel("d", 14, 1.0)]
    runs, _ = runs_of(overlapping, 1, cuda=True)
    assert runs == [[Op("a", 1.0), Op("b", 2.0), Op("c", 0.0), Op("d", 1.0)]]
    # the step's mark reaches the device as a range over the whole step: no kernel, and it takes no kernel's time
    marked = [kernel("trtbuild.profile.step", 9, 7.0), *overlapping]
    runs, _ = runs_of(marked, 1, cuda=True)
    assert runs == [[Op("a", 1.0), Op("b", 2.0), Op("c", 0.0), Op("d", 1.0)]]


def test_ceilings_are_measured_once_per_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(ceilings, "measure", lambda device, b, n: calls.append((b, n)) or
                        {"copy_Bps": 1.0, "matmul_flops_per_s": 2.0})
    first = ceilings.cached("cpu", tmp_path)
    again = ceilings.cached("cpu", tmp_path)
    assert calls == [ceilings.CPU_PROBE] and first["copy_Bps"] == again["copy_Bps"] == 1.0
    assert first["source"].startswith("measured now") and again["source"].startswith("cached in")
    next(tmp_path.glob("*.json")).write_text("{damaged")
    assert ceilings.cached("cpu", tmp_path)["source"].startswith("measured now") and len(calls) == 2


def test_the_probe_measures_both_roofs_on_the_cpu() -> None:
    got = ceilings.measure("cpu", 1 << 20, 64)
    assert got["copy_Bps"] > 0 and got["matmul_flops_per_s"] > 0 and got["matmul_dtype"] == "float32"


@pytest.mark.parametrize(("args", "message"), [
    (["--batch-size", "9"], "--batch-size: 9 exceeds shapes.max_batch_size 2"),
    (["--input-len", "47"], "--input-len: 47 exceeds shapes.max_input_len 16"),
    (["--plot", "out.jpg"], "--plot: out.jpg: expected a .png file name"),
])
def test_bad_flags_are_one_line_before_any_build(tmp_path: Path, args: list[str], message: str) -> None:
    recipe = write_recipe(tmp_path, tiny_recipe_doc())
    result = CliRunner().invoke(main, ["profile", str(recipe), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "engines" / "v1").exists()


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One tiny CPU engine, built and profiled by the real command in a new process, with --json and --plot."""
    root = tmp_path_factory.mktemp("profiled")
    recipe = write_recipe(root, tiny_recipe_doc(shapes={"max_batch_size": 2, "max_input_len": 16, "max_seq_len": 48,
                                                        "batch_buckets": [1, 2]}))
    png = root / "profile.png"
    proc = run_cli("profile", str(recipe), "--engines", str(root / "engines"), "--batch-size", "2",
                   "--input-len", "8", "--json", "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    return {"root": root, "recipe": recipe, "png": png, "result": read_json_line(proc.stdout)}


@pytest.mark.slow
def test_profile_json_has_every_phase_and_site(profiled: dict[str, Any]) -> None:
    result = profiled["result"]
    assert {"recipe", "backend", "device", "engine", "ceilings", "method", "phases", "plot"} <= set(result)
    assert result["device"] == "cpu" and "eagerly" in result["method"]
    assert result["ceilings"]["copy_Bps"] > 0 and result["ceilings"]["source"].startswith("measured now")
    assert set(result["phases"]) == {"prefill", "decode"}
    cfg = LlamaConfig.from_hf(TINY_CONFIG)
    for name, phase in result["phases"].items():
        assert phase["note"] == "" and phase["bucket"] == 2 and phase["runs"] >= 3
        rows = {r["site"]: r for r in phase["rows"]}
        assert {QKV, ATTENTION, O_PROJ, GATE_UP, DOWN, LM_HEAD} <= set(rows)
        for site in (QKV, O_PROJ, GATE_UP, DOWN):
            assert rows[site]["launches"] == cfg.num_layers and rows[site]["kernels"][0]["name"] == "aten::linear"
        assert rows[LM_HEAD]["launches"] == 1
        tokens, start = (8, 0) if name == "prefill" else (1, 8 + (phase["runs"] - 1) / 2)
        sites = call_sites(cfg, 2, tokens, start, 4)
        for site, s in sites.items():
            assert rows[site]["bytes"] == pytest.approx(s.bytes) and rows[site]["flops"] == pytest.approx(s.flops)
            assert rows[site]["verdict"] in ("memory-bound", "compute-bound", "latency-bound")
        # every kernel's share and the time between them make up the profiled step
        assert sum(r["share"] for r in phase["rows"]) + phase["between_share"] == pytest.approx(1.0, abs=1e-9)
        assert phase["kernel_s"] + phase["between_s"] == pytest.approx(phase["step_s"])
        assert 0 < phase["kernel_s"] <= phase["step_s"]  # on the CPU the operators run inside the step
        assert phase["engine_step_s"] > 0 and phase["launches"] == sum(r["launches"] for r in phase["rows"])
        assert len(phase["top_gains"]) == 3 and phase["floor_ratio"] > 1


@pytest.mark.slow
def test_profile_writes_a_png(profiled: dict[str, Any]) -> None:
    data = profiled["png"].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.slow
def test_profile_table_in_a_new_process_reads_the_cached_ceilings(profiled: dict[str, Any]) -> None:
    proc = run_cli("profile", str(profiled["recipe"]), "--engines", str(profiled["root"] / "engines"),
                   "--phase", "decode", "--batch-size", "1")
    assert proc.returncode == 0, proc.stderr
    assert "profiler_start" not in proc.stderr  # kineto's own lines kept off the command's output
    out = proc.stdout
    assert "decode: batch 1 (bucket 1)" in out and "prefill:" not in out
    assert QKV in out and "between kernels" in out and "most to gain" in out and "cached in" in out


@pytest.mark.gpu
def test_gpu_decode_profile_names_every_kernel_and_matches_the_step(tmp_path: Path) -> None:
    """On CUDA: the decode graph's kernels, seen inside its replays, match the model's call sites; the rows are
    shares of the step `run` times (the profiler's own slowing of the replay left out), which holds them."""
    recipe = write_recipe(tmp_path, tiny_recipe_doc(precision="bf16", tactics={"level": "default"},
                                                    shapes={"max_batch_size": 2, "max_input_len": 16,
                                                            "max_seq_len": 48, "batch_buckets": [1, 2]}))
    proc = run_cli("profile", str(recipe), "--engines", str(tmp_path / "engines"), "--json")
    assert proc.returncode == 0, proc.stderr
    result = read_json_line(proc.stdout)
    assert "CUDA graphs" in result["method"]
    for name, phase in result["phases"].items():
        assert phase["note"] == "", (name, [r["site"] for r in phase["rows"]])
        rows = {r["site"]: r for r in phase["rows"]}
        assert rows[QKV]["launches"] >= 2 and rows[LM_HEAD]["launches"] >= 1
    decode = result["phases"]["decode"]
    assert decode["step_s"] == decode["engine_step_s"] and decode["profiled_step_s"] >= decode["kernel_s"]
    # a tiny step's kernels may run side by side a little (programmatic launch); benchmarks/profile_check.py
    # checks at real sizes that they account for the step within 5%
    assert 0 < decode["kernel_s"] <= 1.10 * decode["step_s"]
    json.dumps(result)


def test_kept_ceilings_say_their_age_and_how_to_refresh_and_a_site_above_a_roof_calls_them_implausible(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import time

    calls = []
    monkeypatch.setattr(ceilings, "measure", lambda device, b, n: calls.append(n) or
                        {"copy_Bps": 1e12, "matmul_flops_per_s": 1e14})
    ceilings.cached("cpu", tmp_path)
    kept = next(tmp_path.glob("*.json"))
    doc = json.loads(kept.read_text())
    kept.write_text(json.dumps(doc | {"measured_at": time.time() - 3 * 86400}))
    again = ceilings.cached("cpu", tmp_path)
    assert "measured 3 days ago" in again["source"] and "--remeasure" in again["source"] and len(calls) == 1
    assert ceilings.cached("cpu", tmp_path, fresh=True)["source"].startswith("measured now") and len(calls) == 2
    assert os.path.getsize(kept) > 0
    cfg = LlamaConfig.from_hf(TINY_CONFIG)
    sites = call_sites(cfg, 1, 1, 7, 4)
    steps = [[Op(n, 3.0) for n in _layer(["attn"]) * 2 + ["gemv_head", "argmax"]]]
    plausible = {"phases": {"decode": table(steps, 60e-6, sites, 2, CEILINGS)}}
    assert ceilings.implausible(plausible) == []
    low = CEILINGS | {"copy_Bps": 1e3}  # roofs measured while something else held the machine
    assert f"decode: {QKV}" in ceilings.implausible({"phases": {"decode": table(steps, 60e-6, sites, 2, low)}})


@pytest.mark.parametrize("columns", [100, 220])
def test_the_profile_table_fits_the_terminal_keeps_call_sites_whole_and_puts_the_engines_step_first(
        columns: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from trtbuild.measure.profile_report import print_profile

    monkeypatch.setenv("COLUMNS", str(columns))
    cfg = LlamaConfig.from_hf(TINY_CONFIG)
    sites = call_sites(cfg, 1, 1, 7, 4)
    names = _layer(["a_very_long_attention_kernel_name_from_inductor_fused_rope_cat_mm"]) * 2 + ["gemv_head", "argmax"]
    phase = table([[Op(n, 3.0) for n in names]], 61_243.6e-6, sites, 2, CEILINGS)
    result = {"recipe": "tiny", "device": "cpu", "method": "eager", "ceilings": CEILINGS | {"device_name": "cpu x2"},
              "phases": {"decode": {"batch_size": 1, "bucket": 1, "prompt_len": 7, "runs": 1,
                                    "engine_step_s": 145.1e-6, **phase}}}
    print_profile(result)
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= columns, out
    for row in phase["rows"]:
        assert row["site"] in out, (row["site"], out)  # whole, on one line
    assert "layers…" not in out and "…" not in "".join(line[:40] for line in out.splitlines())
    step = next(line for line in out.splitlines() if line.startswith("  step"))
    assert step.index("145.1 µs as `run` times the engine") < step.index("61,243.6")
    floor = phase["floor_s"]
    assert f"the engine's step is {145.1e-6 / floor:.2f}x its floor" in out


def test_a_quantized_engines_matmul_bytes_are_its_stored_bytes() -> None:
    """An int4_wo engine's weights are half a byte each plus their groups' scales and zeros (its down projections
    kept int8): the profile's floor counts those bytes, not two a weight, and a dense model's are unchanged."""
    from trtbuild.models.calibrate import rtn_state
    from trtbuild.measure.profile import stored_weight_bytes

    cfg = LlamaConfig.from_hf(TINY_CONFIG)
    torch.manual_seed(0)
    dense = {k: v for k, v in Transformer(cfg, 2, 48, torch.float32).state_dict().items()}
    assert stored_weight_bytes(dense)[QKV] == cfg.num_layers * 4 * cfg.hidden_size * (
        cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    packed = rtn_state(dense, "int4")
    stored = stored_weight_bytes(packed)
    qkv = [k for k in packed if ".wqkv." in k]
    assert {k.rsplit(".", 1)[1] for k in qkv} == {"qweight", "scale", "zero"}
    assert stored[QKV] == sum(packed[k].numel() * packed[k].element_size() for k in qkv)
    assert stored[QKV] < 0.2 * stored_weight_bytes(dense)[QKV]  # about 0.5 + 4/32 bytes against 4 a weight
    plain, quant = call_sites(cfg, 1, 1, 7, 4), call_sites(cfg, 1, 1, 7, 4, stored)
    weights = stored_weight_bytes(dense)
    for site in (QKV, LM_HEAD):
        assert quant[site].bytes == plain[site].bytes - weights[site] + stored[site]
        assert quant[site].flops == plain[site].flops
