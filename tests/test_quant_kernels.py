"""The quantized decode matmul (kernels/quant_matmul.py) through Triton's interpreter on the CPU, and compiled
on a GPU, against the dequantized matmul (models/quantize.py's reference). Skipped where Triton is not
installed. fp32 activations on the CPU: the interpreter's bf16 dot is not reliable (tests/test_kernels.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # read when the kernels are defined, so before they are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def _case(fmt: str, rows: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    from trtbuild.models import quantize

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.linspace(0.05, 1.0, n)[:, None]
    stored = {name: t.to(DEVICE) for name, t in quantize.quantize(fmt, w).items()}
    x = torch.randn(rows, k, generator=g).to(DEVICE, DTYPE)
    dense = quantize.dequantize(fmt, stored["qweight"], stored["scale"], stored.get("zero"), DTYPE)
    return x, stored, F.linear(x.float(), dense.float())


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 40, 256), (3, 40, 256), (2, 24, 192), (1, 8, 96)])
def test_quantized_decode_matmul_matches_the_dequantized_matmul(fmt: str, rows: int, n: int, k: int) -> None:
    """One row (multiply-and-sum) and several (dot); n not a multiple of the block (masked columns); k 192 and
    96: int4 groups of 64 and 32, and for fp8/int8 a last block of k that is masked."""
    from trtbuild.kernels.quant_matmul import MatmulConfig, quant_matmul

    x, stored, want = _case(fmt, rows, n, k, rows * n + k)
    got = quant_matmul(x, stored["qweight"], stored["scale"], stored.get("zero"), MatmulConfig(16, 128, 4, 1))
    tol = 2e-2 if DTYPE == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)


@pytest.mark.parametrize(("rows", "k"), [(1, 512), (3, 1536), (2, 256)])
def test_int4_steps_of_several_groups_gather_each_groups_scale_and_zero(rows: int, k: int) -> None:
    """Steps of up to 512 columns: 4, 4 and 2 groups of 128 a step (k 1536 and 256: the most that divide K)."""
    from trtbuild.kernels.quant_matmul import MatmulConfig, quant_matmul

    x, stored, want = _case("int4", rows, 24, k, k + rows)
    got = quant_matmul(x, stored["qweight"], stored["scale"], stored["zero"], MatmulConfig(8, 512, 4, 1))
    tol = 2e-2 if DTYPE == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)


def test_a_scale_or_nibble_read_wrongly_would_be_caught() -> None:
    """The check above is not vacuous: swapping the nibbles of one byte changes the result beyond its tolerance."""
    from trtbuild.kernels.quant_matmul import MatmulConfig, quant_matmul

    x, stored, want = _case("int4", 2, 16, 128, 7)
    q = stored["qweight"].clone()
    q[:, 0] = (q[:, 0] >> 4) | ((q[:, 0] & 15) << 4)
    if torch.equal(q, stored["qweight"]):
        pytest.skip("the first bytes happen to be symmetric")
    got = quant_matmul(x, q, stored["scale"], stored["zero"], MatmulConfig(16, 128, 4, 1))
    assert (got.float() - want).abs().max() > 1e-3 * want.abs().max()


def _every_candidate() -> list[tuple[str, int, str]]:
    """(format, rows, configuration name) for every candidate of every list: the one-row lists at 1 row, the
    tensor-core lists at 2 and 8. Candidates that differ only in warps or stages are one case here: the
    interpreter runs neither (they change the compiled code's schedule, not what it computes)."""
    from trtbuild.kernels import matmul_configs as mc

    out: dict[tuple[str, int, int, int, int], tuple[str, int, str]] = {}
    for fmt in ("int4", "fp8"):
        for rows, configs in ((1, mc.QUANT_ONE_ROW[fmt] + mc.QUANT_ONE_ROW_SPLIT),
                              (2, mc.QUANT_ROWS[fmt] + mc.QUANT_ROWS_SPLIT), (8, mc.QUANT_ROWS[fmt] + mc.QUANT_ROWS_SPLIT)):
            for c in configs:
                out.setdefault((fmt, rows, c.block_n, c.block_k, c.split), (fmt, rows, c.name))
    return list(out.values())


@pytest.mark.parametrize(("fmt", "rows", "name"), _every_candidate())
def test_every_candidate_matches_the_dequantized_matmul(fmt: str, rows: int, name: str) -> None:
    """Each configuration the build may choose, on a shape with an odd number of columns (a partly masked block)
    and one step more than whole: int4 in groups of 128, the last step three groups long (the rest masked
    whole); fp8 with a last step of 40 columns. Split-K slices end where k does."""
    from trtbuild.kernels.quant_matmul import MatmulConfig, launch_shape, quant_matmul

    config = MatmulConfig.parse(name)
    k = config.block_k + (3 * 128 if fmt == "int4" else 40)
    n = 2 * config.block_n + 3
    x, stored, want = _case(fmt, rows, n, k, 11 * rows + k)
    assert launch_shape(config, rows, k, 128 if fmt == "int4" else 0) == (config.block_n, config.block_k)
    got = quant_matmul(x, stored["qweight"], stored["scale"], stored.get("zero"), config)
    tol = 2e-2 if DTYPE == torch.bfloat16 else 1e-4
    torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)


def test_candidates_are_pruned_by_what_cannot_win_at_the_shape() -> None:
    """Llama 1B's down projection (2048 x 8192) at batch 1 keeps split-K, where 4-row blocks give 512 programs
    for 132 SMs; 8B's gate/up (28672 x 4096) has programs enough and keeps none. Narrow matrices drop the steps
    and blocks more than twice their size; int4 keeps only whole groups, at most 16 a step, and on one row tiles
    whose partial sums fit the registers (fp8 and int8 too, whose one-row tile is twice int4's for a step). On
    one row, stages that compile to the same code are timed once."""
    from trtbuild.kernels.matmul_configs import QUANT_ONE_ROW, one_stage, quant_candidates

    down = quant_candidates("int4", 1, 2048, 8192, 128)
    assert {c.name for c in down if c.split > 1} >= {"n4k512w4s1p2", "n4k512w4s1p4", "n8k1024w4s1p4"}
    # every unsplit one-row candidate but the 16 x 2048 tile, whose partial sums would not fit the registers,
    # one of each pair that differs only in stages
    assert [c for c in down if c.split == 1] == one_stage(
        [c for c in QUANT_ONE_ROW["int4"] if c.block_n * c.block_k < 32768])
    assert any(c.block_n * c.block_k >= 32768 for c in QUANT_ONE_ROW["int4"])
    assert len({(c.block_n, c.block_k, c.warps, c.split) for c in down}) == len(down)
    assert {c.stages for c in QUANT_ONE_ROW["int4"]} == {1, 3}
    int8_down = quant_candidates("int8", 1, 2048, 8192)
    assert max(c.block_n * c.block_k for c in int8_down) == 8192  # n4k2048 in, n8k2048 and n16k1024 out
    gated = quant_candidates("fp8", 1, 8192, 2048, epilogue="gate")
    assert max(c.block_n * c.block_k for c in gated) == 4096  # two weight rows a column
    # several rows keep their stages: there the tensor-core loop is pipelined
    assert {c.stages for c in quant_candidates("int4", 8, 2048, 2048, 128)} == {1, 3}
    assert not any(c.split > 1 for c in quant_candidates("int4", 1, 28672, 4096, 128))
    assert not any(c.split > 1 for c in quant_candidates("fp8", 1, 2048, 8192, 0, sms=16))  # a small GPU is full
    small = quant_candidates("int4", 1, 6, 576, 64)
    assert small and all(c.block_k <= 1024 and c.block_k % 64 == 0 and c.block_n <= 8 for c in small)
    assert all(c.block_k // 32 <= 16 for c in quant_candidates("int4", 1, 4096, 4096, 32))
    assert {c.name for c in quant_candidates("int8", 8, 4096, 4096)} == {c.name for c in quant_candidates("fp8", 8, 4096, 4096)}


def test_quantized_decode_routes_each_quantized_linear_to_its_planned_configuration() -> None:
    """export.quantized_decode: the plan's configuration for its (out, in, format), the format's fixed one where
    the plan has none, and nothing past the kernel's 16 rows or on the CPU (the graphs then dequantize)."""
    from types import SimpleNamespace

    from trtbuild.backends.torch.export import place_model, quantized_decode
    from trtbuild.kernels.quant_matmul import CONFIGS, MatmulConfig
    from trtbuild.models import calibrate
    from trtbuild.models.checkpoint import convert_hf_state_dict, hf_parameter_shapes
    from trtbuild.models.llama import LlamaConfig

    from .conftest import TINY_CONFIG

    cfg = LlamaConfig.from_hf(TINY_CONFIG)
    hf = {k: torch.randn(s) * 0.2 for k, s in hf_parameter_shapes(cfg).items()}
    state = calibrate.rtn_state(convert_hf_state_dict(hf, cfg), "int4")
    model = place_model(cfg, SimpleNamespace(max_batch_size=2, max_input_len=8, max_seq_len=16), torch.float32,
                        "cpu", state)
    quantized = [m for m in model.modules() if getattr(m, "quant", None)]
    first = quantized[0]
    chosen = MatmulConfig(8, 512, 4, 3, 2)
    with quantized_decode(model, "cuda", {(first.out_features, first.in_features, "int4"): chosen}, 2):
        shape = (first.out_features, first.in_features)
        assert {m.decode_config for m in quantized if (m.out_features, m.in_features) == shape} == {chosen}
        assert {m.decode_config for m in quantized if (m.out_features, m.in_features) != shape} == {CONFIGS["int4"]}
    assert all(m.decode_config is None for m in quantized)
    for device, rows in (("cuda", 32), ("cpu", 2)):
        with quantized_decode(model, device, {}, rows):
            assert all(m.decode_config is None for m in quantized)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 8])
def test_the_custom_op_compiled_on_the_gpu_matches_the_dequantized_matmul(fmt: str, rows: int) -> None:
    """The op the decode graphs call, on Llama-3 8B's QKV shape, bf16 activations."""
    from trtbuild.kernels.quant_matmul import CONFIGS, quant_matmul_op

    x, stored, want = _case(fmt, rows, 6144, 4096, rows)
    c = CONFIGS[fmt]
    got = quant_matmul_op(x, stored["qweight"], stored["scale"], stored.get("zero"), c.block_n, c.block_k, c.warps,
                          c.stages)
    torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("split", [1, 4])
def test_the_custom_op_with_an_epilogue_compiled_on_the_gpu_matches_the_reference(fmt: str, rows: int,
                                                                                   split: int) -> None:
    """The op with the gating (Llama-3.2 1B's gate/up, 16384 x 2048) and with the residual add (its down
    projection, 2048 x 8192), whole or split-K (the reduction doing the epilogue), bf16 activations."""
    from trtbuild.kernels.quant_matmul import quant_matmul_op, reference

    for epilogue, n, k in (("gate", 16384, 2048), ("residual", 2048, 8192)):
        x, stored, _ = _case(fmt, rows, n, k, rows + split)
        q, s, z = stored["qweight"], stored["scale"], stored.get("zero")
        residual = torch.randn(rows, n, device=DEVICE, dtype=DTYPE) if epilogue == "residual" else None
        want = reference(x, q, s, z, epilogue, residual)
        got = quant_matmul_op(x, q, s, z, 16 if rows > 1 else 4, 512, 4, 3, split, epilogue == "gate", residual)
        torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.gpu
def test_fp8_prefill_on_tensor_cores_is_close_to_the_dequantized_matmul() -> None:
    """quantize.fp8_linear: per-token fp8 activations times the fp8 weight through torch._scaled_mm."""
    from trtbuild.models import quantize

    x, stored, want = _case("fp8", 256, 1024, 2048, 3)
    got = quantize.fp8_linear(x, stored["qweight"], stored["scale"], None)
    assert got.dtype == x.dtype and got.shape == want.shape
    rel = (got.float() - want).norm() / want.norm()
    assert rel < 0.05, rel  # activations rounded to fp8 too: a few percent, not more


def _int4_pair(seed: int) -> tuple[Any, list[Any]]:
    """The tiny model's config, and two copies of it in int4 (round to nearest) from seeded weights, placed on
    DEVICE in fp32: one to route through the kernel, one to dequantize."""
    from types import SimpleNamespace

    from trtbuild.backends.torch.export import place_model
    from trtbuild.models import calibrate
    from trtbuild.models.checkpoint import convert_hf_state_dict, hf_parameter_shapes
    from trtbuild.models.llama import LlamaConfig

    from .conftest import TINY_CONFIG

    cfg = LlamaConfig.from_hf(TINY_CONFIG)
    g = torch.Generator().manual_seed(seed)
    hf = {k: torch.randn(s, generator=g) * 0.2 for k, s in hf_parameter_shapes(cfg).items()}
    state = calibrate.rtn_state(convert_hf_state_dict(hf, cfg), "int4")
    shapes = SimpleNamespace(max_batch_size=2, max_input_len=8, max_seq_len=16)
    return cfg, [place_model(cfg, shapes, torch.float32, DEVICE, {k: v.clone() for k, v in state.items()})
                 for _ in range(2)]


def test_a_decode_step_through_the_quantized_kernel_gives_the_logits_of_the_dequantizing_model() -> None:
    """Linear._kernel's quantized branch: every quantized Linear of a tiny int4 model routed to the kernel
    (as `export.quantized_decode` does on CUDA) against the same model dequantizing in ATen."""
    from trtbuild.kernels.quant_matmul import CONFIGS

    cfg, models = _int4_pair(0)
    routed = [m for m in models[1].modules() if getattr(m, "quant", None)]
    assert len(routed) == 4 * cfg.num_layers
    for m in routed:
        m.decode_config = CONFIGS[m.quant]
    tokens = torch.tensor([[3, 9, 1, 4], [7, 2, 8, 5]], device=DEVICE)
    with torch.no_grad():
        logits = []
        for model in models:
            model(tokens, torch.arange(4, device=DEVICE), from_start=True)  # the prompt, dequantizing (prefill)
            logits.append(model(tokens[:, :1], torch.tensor([4], device=DEVICE)))
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


def test_the_build_times_each_quantized_shape_once_per_batch_and_plans_the_fastest(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """decode_kernels.matmul_plan on a tiny int4 model, with stand-ins for the kernels' selections (the real ones
    need a GPU): each (out, in, int4) is timed once per batch over its layers, its fastest candidate planned under
    the format's key and recorded beside the dense LM head's, cached so a rebuild times nothing; a batch past the
    kernel's 16 rows times nothing; a shape where no candidate ran keeps the fixed configuration."""
    from types import SimpleNamespace

    from trtbuild.backends.torch import decode_kernels
    from trtbuild.backends.torch.export import place_model
    from trtbuild.kernels import decode_matmul as dm
    from trtbuild.kernels import quant_matmul as qm
    from trtbuild.kernels.matmul_configs import MatmulConfig
    from trtbuild.models import calibrate
    from trtbuild.models.checkpoint import convert_hf_state_dict, hf_parameter_shapes
    from trtbuild.models.llama import LlamaConfig

    from .conftest import TINY_CONFIG

    timed: list[tuple[int, int, int, int]] = []

    def select(layers: list[tuple[torch.Tensor, ...]], rows: int, reps: int = 15,
               configs: list[MatmulConfig] | None = None, epilogue: str = "none") -> dict[str, Any]:
        n, k = layers[0][0].shape[0], layers[0][0].shape[1] * 2
        timed.append((n, k, rows, len(layers)))
        assert epilogue == "none"  # options.decode_fusion none: the kernel does the matmul alone
        assert configs  # the build's pruned list, as its cache key names it
        if n == k:  # the output projection: nothing ran
            return {"format": "int4", "choice": None, "candidates": {c.name: "failed: no" for c in configs}}
        us = {c.name: 10.0 + i for i, c in enumerate(configs)}
        return {"format": "int4", "choice": configs[-1].name, "candidates": us | {configs[-1].name: 1.0}}

    monkeypatch.setattr(qm, "select", select)
    monkeypatch.setattr(dm, "select", lambda weights, rows, fusion="none", split=False, configs=None: {
        "fusion": fusion, "cublas_us": 5.0, "choice": "cublas", "candidates": {}})
    cfg = LlamaConfig.from_hf(TINY_CONFIG)
    hf = {k: torch.randn(s) * 0.2 for k, s in hf_parameter_shapes(cfg).items()}
    monkeypatch.setattr(calibrate, "INT4_KEPT_INT8", ())  # every projection int4: four int4 shapes to time
    state = calibrate.rtn_state(convert_hf_state_dict(hf, cfg), "int4")
    model = place_model(cfg, SimpleNamespace(max_batch_size=2, max_input_len=8, max_seq_len=16), torch.float32,
                        "cpu", state)
    from trtbuild.backends.torch import kernel_warmup

    ahead: list[list[tuple[Any, ...]]] = []  # what the plan handed over to be compiled ahead of its timings
    monkeypatch.setattr(kernel_warmup, "precompile", lambda work, device, progress: ahead.append(work) or {})
    job = SimpleNamespace(tactics=SimpleNamespace(path=tmp_path), progress=lambda message: None)
    plan, record = decode_kernels.matmul_plan(model, (1, 32), "default", "auto", "cuda", job, "none")  # type: ignore[arg-type]
    d, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    quantized = [(qkv, d), (d, cfg.num_heads * cfg.head_dim), (2 * f, d), (d, f)]
    assert sorted(timed) == sorted((n, k, 1, layers) for n, k in quantized)  # none at 32 rows
    # every quantized timing's candidates were compiled ahead, with the layers' own layout
    quant_work = [w for w in ahead[0] if w[3] == "int4"]
    assert sorted((n, k) for _, n, k, _, _, _ in quant_work) == sorted(quantized)
    assert all(rows == 1 and len(spec) == 3 and spec[0][1] == "torch.uint8" for rows, _, _, _, spec, _ in quant_work)
    assert d == cfg.num_heads * cfg.head_dim  # the output projection: the stand-in's shape where nothing ran
    lists = {(n, k): qm.candidates_for(*next((m.qweight, m.scale, m.zero) for m in model.modules()
                                             if getattr(m, "quant", None) and (m.out_features, m.in_features) == (n, k)), 1)
             for n, k in quantized}
    assert plan[1] == {(n, k, "int4"): lists[(n, k)][-1] for n, k in quantized if n != k}
    entry = record["decode_b1"][f"{2 * f}x{d}+int4"]
    assert entry["used"] == lists[(2 * f, d)][-1].name and entry["calls"] == layers and entry["chosen_us"] == 1.0
    assert record["decode_b1"][f"{d}x{d}+int4"]["used"].endswith("(fixed: no candidate ran, no epilogue)")
    assert decode_kernels.fused_outside(record, 1) == []  # the quantized kernel's fusions are not the dense kind
    assert decode_kernels.timed_step_us(record, 1) == 3 * layers * 1.0 + 5.0  # and cuBLAS's LM head, once
    timed.clear()
    again, _ = decode_kernels.matmul_plan(model, (1,), "default", "auto", "cuda", job, "none")  # type: ignore[arg-type]
    assert again == plan and timed == []  # from the tactic cache


@pytest.mark.parametrize("fmt", ["int4", "int8", "fp8"])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_kernel_does_the_gating_and_the_residual_add_of_its_call_site(fmt: str, rows: int) -> None:
    """gate: a [2N, K] weight (gate rows, then up rows, each with its own scales), y = silu(gate) * up; residual:
    y = r + x @ w^T. Against the reference over the dequantized weight; N not a multiple of the block."""
    from trtbuild.kernels.quant_matmul import MatmulConfig, quant_matmul, reference

    tol = 2e-2 if DTYPE == torch.bfloat16 else 1e-4
    for epilogue in ("gate", "residual"):
        x, stored, _ = _case(fmt, rows, 2 * 21, 256, rows + len(fmt))
        q, s, z = stored["qweight"], stored["scale"], stored.get("zero")
        residual = torch.randn(rows, 42, generator=torch.Generator().manual_seed(5)).to(DEVICE, DTYPE)
        residual = residual if epilogue == "residual" else None
        want = reference(x, q, s, z, epilogue, residual)
        assert want.shape == (rows, 21 if epilogue == "gate" else 42)
        got = quant_matmul(x, q, s, z, MatmulConfig(8, 128, 4, 1), gate=epilogue == "gate", residual=residual)
        torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)
        # not vacuous: the plain matmul differs from the fused result beyond the tolerance
        plain = quant_matmul(x, q, s, z, MatmulConfig(8, 128, 4, 1))
        assert plain.shape != want.shape or (plain.float() - want).abs().max() > 10 * tol * want.abs().max()


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_split_k_with_an_epilogue_does_it_in_the_reduction(fmt: str) -> None:
    """The gating and the add need each column's whole sum: with split-K the partial sums (gated: the gate's and the
    up half's side by side) go to the reduction, which does the epilogue. The build's list for a fused site keeps
    split-K (at batch 8 on an H100 it was up to twice as fast at the 1B down projection), and gated int4 drops the
    tiles two weight rows would overflow."""
    from trtbuild.kernels.matmul_configs import INT4_TILE, quant_candidates
    from trtbuild.kernels.quant_matmul import MatmulConfig, quant_matmul, reference

    tol = 2e-2 if DTYPE == torch.bfloat16 else 1e-4
    for rows, split in ((1, 2), (3, 4)):
        x, stored, _ = _case(fmt, rows, 2 * 13, 512, rows + split)
        q, s, z = stored["qweight"], stored["scale"], stored.get("zero")
        residual = torch.randn(rows, 26, generator=torch.Generator().manual_seed(2)).to(DEVICE, DTYPE)
        for epilogue, r in (("gate", None), ("residual", residual)):
            want = reference(x, q, s, z, epilogue, r)
            got = quant_matmul(x, q, s, z, MatmulConfig(8, 128, 4, 1, split), gate=epilogue == "gate", residual=r)
            torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)
    for epilogue in ("gate", "residual"):
        assert any(c.split > 1 for c in quant_candidates("int4", 1, 2048, 8192, 128, epilogue=epilogue))
    gated = quant_candidates("int4", 1, 8192, 2048, 128, epilogue="gate")
    assert gated and all(2 * c.block_n * c.block_k // 2 <= INT4_TILE * c.warps // 4 for c in gated)
    assert len(gated) < len(quant_candidates("int4", 1, 8192, 2048, 128))


def test_the_plan_fuses_each_quantized_call_sites_epilogue_and_routes_it(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """options.decode_fusion epilogue on a tiny int4 model: gate/up is timed with the gating and the output and
    down projections with the residual add (QKV, whose norm stays outside, plain); the plan's keys say so, and
    `export.quantized_decode` routes each Linear with its epilogue, so a decode step through the kernel (the
    interpreter here) still gives the dequantizing model's logits."""
    from types import SimpleNamespace

    from trtbuild.backends.torch import decode_kernels, kernel_warmup
    from trtbuild.backends.torch.export import quantized_decode
    from trtbuild.kernels import decode_matmul as dm
    from trtbuild.kernels import quant_matmul as qm
    from trtbuild.kernels.matmul_configs import MatmulConfig
    from trtbuild.models import calibrate

    asked: dict[tuple[int, int], str] = {}

    def select(layers: list[tuple[torch.Tensor, ...]], rows: int, reps: int = 15,
               configs: list[MatmulConfig] | None = None, epilogue: str = "none") -> dict[str, Any]:
        asked[(layers[0][0].shape[0], layers[0][0].shape[1] * 2)] = epilogue
        assert configs
        return {"format": "int4", "epilogue": epilogue, "choice": "n8k128w4s1", "candidates": {"n8k128w4s1": 2.0}}

    monkeypatch.setattr(qm, "select", select)
    monkeypatch.setattr(dm, "select", lambda weights, rows, fusion="none", split=False, configs=None: {
        "fusion": fusion, "cublas_us": 5.0, "choice": "cublas", "candidates": {}})
    monkeypatch.setattr(kernel_warmup, "precompile", lambda work, device, progress: {})
    monkeypatch.setattr(calibrate, "INT4_KEPT_INT8", ())
    cfg, models = _int4_pair(1)
    job = SimpleNamespace(tactics=SimpleNamespace(path=tmp_path), progress=lambda message: None)
    plan, record = decode_kernels.matmul_plan(models[1], (1,), "default", "auto", "cuda", job)  # type: ignore[arg-type]
    d, f = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    assert asked == {(qkv, d): "none", (2 * f, d): "gate", (d, d): "residual", (d, f): "residual"}
    assert set(plan[1]) >= {(qkv, d, "int4"), (2 * f, d, "int4+gate"), (d, d, "int4+residual"), (d, f, "int4+residual")}
    assert record["decode_b1"][f"{2 * f}x{d}+int4+gate"]["kernel_does"] == "gate"
    assert decode_kernels.fused_outside(record, 1) == []
    with quantized_decode(models[1], "cuda", plan[1], 1):
        does = {(m.out_features, m.in_features): m.decode_fusion
                for m in models[1].modules() if getattr(m, "quant", None)}
        assert does == {(qkv, d): "none", (2 * f, d): "gate", (d, d): "residual", (d, f): "residual"}
        if DEVICE == "cpu":  # the graphs would route only on CUDA: route by hand for the interpreter
            tokens = torch.tensor([[3, 9, 1, 4], [7, 2, 8, 5]])
            with torch.no_grad():
                logits = []
                for model in models:
                    model(tokens, torch.arange(4), from_start=True)  # the prompt, dequantizing (prefill)
                    logits.append(model(tokens[:, :1], torch.tensor([4])))
            torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)
    assert all(m.decode_fusion == "none" for m in models[1].modules() if getattr(m, "quant", None))


def test_a_compile_worker_launches_a_fused_site_as_the_timing_will() -> None:
    """kernel_warmup: a quantized site's kind is its format and epilogue ("int4+gate"), and the worker launches the
    kernel gated (half as many output columns) or with a residual, so that the timing finds that variant compiled."""
    from trtbuild.backends.torch import kernel_warmup

    spec = (((32, 128), "torch.uint8"), ((32, 2), "torch.float32"), ((32, 2), "torch.float32"))
    inputs: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for kind, width in (("int4+gate", 16), ("int4+residual", 32), ("int4", 32)):
        site = (1, 32, 256, kind, spec)
        kernel_warmup._launch_quantized(inputs, site, "n8k128w4s1", DEVICE)
        x, q, s, z, y, residual = inputs[site]
        assert y.shape == (1, width) and (residual is not None) == (kind == "int4+residual")


def test_the_nibble_ptx_turns_each_of_four_bytes_nibbles_into_one_plus_q_over_16() -> None:
    """The inline PTX that the GPU runs in place of the byte-by-byte path (the interpreter cannot run it), read
    and executed instruction by instruction here: for every byte value in each of the four positions, output j
    (0-3: bytes 0-3's low nibbles, 4-7: their high ones) is the fp32 1 + q/16."""
    import re
    import struct

    import ast
    from pathlib import Path

    source = (Path(__file__).resolve().parents[1] / "trtbuild" / "kernels" / "quant_matmul.py").read_text()
    nibbles = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "_int4_nibbles")
    ptx = next(c.args[0].value for c in ast.walk(nibbles)
               if isinstance(c, ast.Call) and getattr(c.func, "attr", None) == "inline_asm_elementwise")
    program = re.findall(r"(shl|shr)\.b32 t, \$8, (\d+); lop3\.b32 \$(\d), t, (0x[0-9A-Fa-f]+), (0x[0-9A-Fa-f]+), "
                         r"(0x[0-9A-Fa-f]+);", ptx)
    assert len(program) == 8 and ptx.count(";") == 16 + 1  # the eight pairs and the register's declaration

    def lop3(a: int, b: int, c: int, lut: int) -> int:
        return sum(((lut >> ((((a >> i) & 1) << 2) | (((b >> i) & 1) << 1) | ((c >> i) & 1))) & 1) << i
                   for i in range(32))

    for value in range(256):
        for position in range(4):
            register = (value << (8 * position)) | (0x5A << (8 * ((position + 1) % 4)))  # a neighbour byte too
            outs = {}
            for op, amount, j, b, c, lut in program:
                t = (register << int(amount)) & 0xFFFFFFFF if op == "shl" else register >> int(amount)
                outs[int(j)] = struct.unpack("<f", struct.pack("<I", lop3(t, int(b, 16), int(c, 16), int(lut, 16))))[0]
            assert outs[position] == 1 + (value & 15) / 16
            assert outs[4 + position] == 1 + (value >> 4) / 16
