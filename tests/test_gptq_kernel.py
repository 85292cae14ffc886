"""GPTQ's per-channel column loop as one Triton launch a block (kernels/gptq_block.py) against the torch loop
(`gptq.channel_block`): through Triton's interpreter on the CPU, compiled on a GPU. Skipped where Triton is
not installed."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # read when the kernels are defined, so before they are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _hinv(b: int, g: torch.Generator) -> torch.Tensor:
    """The upper Cholesky factor of the inverse of a random positive definite (b, b), as gptq_channel makes it."""
    x = torch.randn(4 * b, b, generator=g)
    h = x.T @ x / (4 * b) + 0.01 * torch.eye(b)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_the_rounding_is_the_formats_own_on_every_binade_and_tie(fmt: str) -> None:
    """With no error to spread (H^-1's factor the identity), the codes are round to nearest in the format: fp8
    e4m3 across its normal range and its subnormals, ties to even, and clamped to its top; int8 ties to even."""
    from trtbuild.kernels.gptq_block import channel_block

    top = 448.0 if fmt == "fp8" else 127.0
    g = torch.Generator().manual_seed(1)
    mags = torch.exp2(torch.empty(4096).uniform_(-12, 9.5, generator=g)) if fmt == "fp8" else \
        torch.empty(4096).uniform_(0, 140, generator=g)
    ties = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 1.0625, 1.1875, 2 ** -7 + 2 ** -10, 3 * 2 ** -10, 0.0, 500.0])
    x = torch.cat([mags * torch.where(torch.rand(4096, generator=g) < 0.5, -1.0, 1.0), ties])
    w = torch.nn.functional.pad(x, (0, 64 - x.numel() % 64)).reshape(-1, 64)
    scale = torch.ones(w.shape[0])
    codes, errors = channel_block(w.to(DEVICE), torch.eye(64).to(DEVICE), scale.to(DEVICE), fmt)
    clamped = w.clamp(-top, top)
    want = clamped.to(torch.float8_e4m3fn).float() if fmt == "fp8" else torch.round(clamped)
    assert torch.equal(codes.cpu(), want)
    assert torch.equal(errors.cpu(), w - want)


@pytest.mark.parametrize(("fmt", "n", "b"), [("fp8", 70, 128), ("int8", 70, 128), ("fp8", 33, 48)])
def test_the_block_matches_the_torch_loop(fmt: str, n: int, b: int) -> None:
    """Rows not a multiple of a program's band and a block narrower than 128 (masked columns), on a view of a wider
    weight: the codes and the errors are the torch loop's, bit for bit (IEEE division, no contracted
    multiply-adds, the same order)."""
    from trtbuild.kernels.gptq_block import channel_block
    from trtbuild.models import gptq

    g = torch.Generator().manual_seed(n + b)
    whole = torch.randn(n, b + 64, generator=g) * torch.linspace(0.02, 1.0, n)[:, None]
    w = whole[:, 16:16 + b]
    hinv = _hinv(b, g)
    scale = whole.abs().amax(dim=1) / (448.0 if fmt == "fp8" else 127.0)
    want_codes, want_errors = gptq.channel_block(w, hinv, scale, fmt)
    codes, errors = channel_block(w.to(DEVICE), hinv.to(DEVICE), scale.to(DEVICE), fmt)
    assert torch.equal(codes.cpu(), want_codes) and torch.equal(errors.cpu(), want_errors)
    assert torch.equal(whole[:, 16:16 + b], w)  # the weight is left as it was


def test_the_kernel_is_used_only_where_it_gives_the_torch_loops_codes(monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture) -> None:
    """Checked once a process on a test block: a kernel that rounds one code differently (or fails to compile) is
    set aside with a warning, and GPTQ runs its torch loop."""
    from trtbuild.kernels import gptq_block
    from trtbuild.models import gptq

    device = torch.device(DEVICE)
    assert gptq._checked_kernel(device) is gptq_block.channel_block
    real = gptq_block.channel_block

    def off_by_one(w: torch.Tensor, hinv: torch.Tensor, scale: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
        codes, errors = real(w, hinv, scale, fmt)
        codes[3, 7] += 1
        return codes, errors

    monkeypatch.setattr(gptq_block, "channel_block", off_by_one)
    with caplog.at_level("WARNING"):
        assert gptq._checked_kernel(device) is None
    assert "differ from the torch loop's in 1 places" in caplog.text


_SM90 = """
import json, re, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
sys.path.insert(0, "benchmarks/probes")
from codegen_probe import read_code
from trtbuild.kernels import gptq_block as gb

args = {"w_ptr": "*fp32", "h_ptr": "*fp32", "s_ptr": "*fp32", "q_ptr": "*fp32", "e_ptr": "*fp32", "n": "i32",
        "b": "i32", "stride_wr": "i32", "stride_wc": "i32", "stride_hr": "i32", "stride_hc": "i32", "stride_q": "i32",
        "stride_e": "i32"}
out = {}
for fmt in ("fp8", "int8"):
    consts = {"TOP": 448.0 if fmt == "fp8" else 127.0, "FP8": fmt == "fp8", "BLOCK_R": gb.ROWS, "BLOCK_B": 128}
    sig = {k: ("constexpr" if k in consts else v) for k, v in args.items()} | {k: "constexpr" for k in consts}
    try:
        k = compile(ASTSource(fn=gb._channel_block_kernel, signature=sig, constexprs=consts),
                    target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "enable_fp_fusion": False})
        code = read_code(k)
    except FileNotFoundError as e:  # a Triton without its NVIDIA tools
        print(json.dumps({"skip": str(e)}))
        sys.exit(0)
    out[fmt] = {"regs": code["registers"], "stack": code["stack_bytes"], "fma": len(re.findall(r"fma\\.rn", k.asm["ptx"]))}
print(json.dumps(out))
"""


def test_the_kernel_compiles_for_the_h100_in_registers_without_contracted_multiply_adds() -> None:
    """What the interpreter cannot see: the kernel compiles for sm_90 (a module-level float it reads must be a
    constexpr there), its tiles fit the registers with no stack, and no multiply-add is contracted."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    import triton

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # a process of its own, compiling
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(Path(triton.__file__).resolve().parents[1])])
    proc = subprocess.run([sys.executable, "-c", _SM90], capture_output=True, text=True, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    for fmt, code in result.items():
        assert code["regs"] <= 255 and code["stack"] == 0 and code["fma"] == 0, (fmt, code)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_on_the_gpu_a_whole_weight_by_the_kernel_is_the_torch_loops(fmt: str) -> None:
    """A 1B gate/up-sized weight's GPTQ with the block kernel and with the torch loop (replayed from captured
    graphs, then eager), on the GPU: the same codes and scales, bit for bit."""
    from trtbuild.models import gptq

    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4096, 2048, device="cuda", generator=g) * 0.02
    x = torch.randn(1024, 2048, device="cuda", generator=g)
    h = 2 * x.T @ x / 1024
    results = []
    for kernel, capture in ((True, True), (False, True), (False, False)):
        gptq.CHANNEL_BLOCK_KERNEL, gptq.BlockGraphs.CAPTURE = kernel, capture
        try:
            results.append(gptq.gptq_channel(w, h, fmt))
        finally:
            gptq.CHANNEL_BLOCK_KERNEL, gptq.BlockGraphs.CAPTURE = True, True
            gptq.BLOCK_GRAPHS.clear()
    for other in results[1:]:
        assert torch.equal(results[0]["qweight"].float(), other["qweight"].float())
        assert torch.equal(results[0]["scale"], other["scale"])


@pytest.mark.gpu
def test_on_the_gpu_int4_gptq_replayed_from_graphs_is_the_eager_loops() -> None:
    """int4 GPTQ's block loop (groups of 128 and of 64, the clipping search) replayed from captured CUDA graphs
    gives the eager loop's codes, scales and zeros, bit for bit: the same kernels on the same numbers."""
    from trtbuild.models import gptq

    g = torch.Generator(device="cuda").manual_seed(1)
    for n, k, group in ((3072, 2048, 128), (1024, 576, 64)):
        w = torch.randn(n, k, device="cuda", generator=g) * 0.02
        x = torch.randn(1024, k, device="cuda", generator=g)
        h = 2 * x.T @ x / 1024
        gptq.BlockGraphs.CAPTURE = False
        try:
            eager = gptq.gptq_int4(w, h, group)
        finally:
            gptq.BlockGraphs.CAPTURE = True
        replayed = gptq.gptq_int4(w, h, group)
        gptq.BLOCK_GRAPHS.clear()
        for name in eager:
            assert torch.equal(eager[name], replayed[name]), name
