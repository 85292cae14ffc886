"""The quantized decode matmul (kernels/quant_matmul.py) through Triton's interpreter on the CPU, and compiled
on a GPU, against the dequantized matmul (models/quantize.py's reference). Skipped where Triton is not
installed. fp32 activations on the CPU: the interpreter's bf16 dot is not reliable (tests/test_kernels.py)."""

from __future__ import annotations

import os

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
def test_fp8_prefill_on_tensor_cores_is_close_to_the_dequantized_matmul() -> None:
    """quantize.fp8_linear: per-token fp8 activations times the fp8 weight through torch._scaled_mm."""
    from trtbuild.models import quantize

    x, stored, want = _case("fp8", 256, 1024, 2048, 3)
    got = quantize.fp8_linear(x, stored["qweight"], stored["scale"], None)
    assert got.dtype == x.dtype and got.shape == want.shape
    rel = (got.float() - want).norm() / want.norm()
    assert rel < 0.05, rel  # activations rounded to fp8 too: a few percent, not more


def test_a_decode_step_through_the_quantized_kernel_gives_the_logits_of_the_dequantizing_model() -> None:
    """Linear._kernel's quantized branch: every quantized Linear of a tiny int4 model routed to the kernel
    (as `export.quantized_decode` does on CUDA) against the same model dequantizing in ATen."""
    from types import SimpleNamespace

    from trtbuild.backends.torch.export import place_model
    from trtbuild.kernels.quant_matmul import CONFIGS
    from trtbuild.models import calibrate
    from trtbuild.models.checkpoint import convert_hf_state_dict, hf_parameter_shapes
    from trtbuild.models.llama import LlamaConfig

    from .conftest import TINY_CONFIG

    cfg = LlamaConfig.from_hf(TINY_CONFIG)
    g = torch.Generator().manual_seed(0)
    hf = {k: torch.randn(s, generator=g) * 0.2 for k, s in hf_parameter_shapes(cfg).items()}
    state = calibrate.rtn_state(convert_hf_state_dict(hf, cfg), "int4")
    shapes = SimpleNamespace(max_batch_size=2, max_input_len=8, max_seq_len=16)
    models = [place_model(cfg, shapes, torch.float32, DEVICE, {k: v.clone() for k, v in state.items()}) for _ in range(2)]
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
