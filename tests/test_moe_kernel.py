"""trtbuild's Triton mixture-of-experts gather (kernels/moe_gather.py) against the model's ATen paths: through
Triton's interpreter on the CPU (fp32; skipped where Triton is not installed), compiled on a GPU (bf16)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():  # read when the kernels are defined, so before they are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def moe(experts: int, top_k: int, hidden: int, inner: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from trtbuild.models.moe import MoE

    cfg = SimpleNamespace(num_experts=experts, experts_per_token=top_k, norm_topk_prob=True, hidden_size=hidden,
                          moe_intermediate_size=inner)
    m = MoE(cfg)
    g = torch.Generator().manual_seed(experts * hidden + inner)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return m.to(DEVICE, dtype)


@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inner"),
                         [(1, 8, 2, 64, 48), (3, 6, 3, 40, 72), (8, 16, 4, 200, 130)])
def test_the_gather_kernel_computes_the_models_experts(tokens: int, experts: int, top_k: int, hidden: int,
                                                       inner: int) -> None:
    """Sizes that are not multiples of the kernel's blocks (40, 130, 200), several tokens choosing overlapping
    experts: the kernel's output is the ATen gather's and the dense path's."""
    m = moe(experts, top_k, hidden, inner)
    x = torch.randn(1, tokens, hidden, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    with torch.no_grad():
        want = m(x, lambda t: t, None, gathered=True)
        dense = m(x, lambda t: t, None, gathered=False)
        m.decode_kernel = "kernel"
        got = m(x, lambda t: t, None, gathered=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(want, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_the_gather_kernel_in_bf16_on_the_gpu_is_within_rounding_of_aten() -> None:
    m = moe(128, 8, 2048, 768, torch.bfloat16)
    x = torch.randn(1, 8, 2048, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        want = m(x, lambda t: t, None, gathered=True).float()
        m.decode_kernel = "kernel"
        got = m(x, lambda t: t, None, gathered=True).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_the_kernel_exports_as_one_opaque_op_whose_source_keys_the_compiled_graph(tmp_path: Path) -> None:
    """A decode graph exported with MoE.decode_kernel "kernel" calls trtbuild::moe_gathered as one op (what
    AOTInductor compiles in), and the compiled-graph cache's key takes the kernel's source digest. In a
    process of its own: export traces the op's kernel launch only where Triton's interpreter is off."""
    from .conftest import run_compiled_triton

    script = tmp_path / "export_moe.py"
    script.write_text(
        "import os\n"
        "os.environ.pop('TRITON_INTERPRET', None)\n"
        "from types import SimpleNamespace\n"
        "import torch\n"
        "from trtbuild.models.moe import MoE\n"
        "from trtbuild.backends.torch.decode_kernels import sources_called\n"
        "from trtbuild.kernels.moe_gather import source_digest\n"
        "cfg = SimpleNamespace(num_experts=8, experts_per_token=2, norm_topk_prob=True, hidden_size=64,"
        " moe_intermediate_size=48)\n"
        "m = MoE(cfg)\n"
        "m.decode_kernel = 'kernel'\n"
        "class Step(torch.nn.Module):\n"
        "    def __init__(self): super().__init__(); self.m = m\n"
        "    def forward(self, x): return self.m(x, lambda t: t, None, gathered=True)\n"
        "ep = torch.export.export(Step(), (torch.randn(2, 1, 64),))\n"
        "text = ep.graph_module.print_readable(print_output=False)\n"
        "assert 'torch.ops.trtbuild.moe_gathered.default' in text, text\n"
        "assert sources_called(text) == '\\0trtbuild.moe_gathered ' + source_digest()\n"
        "print('ok')\n")
    run_compiled_triton(script)
