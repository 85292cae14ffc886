"""The Inductor options a build passes per graph and device (backends/torch/inductor.py)."""

from __future__ import annotations

import pytest

from trtbuild.backends.torch.inductor import inductor_configs, quick_wrapper


@pytest.mark.parametrize("graph", ["prefill", "decode_b1", "decode_b8"])
def test_captured_cuda_graphs_compile_their_host_wrapper_quickly(graph: str) -> None:
    """The decode steps and the prefill are replayed from CUDA graphs, so their host wrapper is compiled at -O0
    without line tables (where this torch has the options); the paged graphs, called by the host every step,
    keep Inductor's defaults. A CPU program's wrapper is compiled so too, whatever the graph: on a 2-core host
    it is most of the C++ compile, and its speed a few microseconds of a CPU step."""
    wanted = quick_wrapper()
    assert set(wanted) <= {"aot_inductor.compile_wrapper_opt_level", "aot_inductor.enable_line_tables"}
    assert wanted.get("aot_inductor.compile_wrapper_opt_level", "O0") == "O0"
    for quick in (inductor_configs("default", "cuda", graph), inductor_configs("default", "cpu", graph),
                  inductor_configs("default", "cpu", "paged"), inductor_configs("default", "cpu", "paged_mixed")):
        assert quick.items() >= wanted.items()
    for other in (inductor_configs("default", "cuda", "paged"), inductor_configs("default", "cuda", "paged_mixed")):
        assert not set(wanted) & set(other)


def test_no_build_proves_vector_isas_in_new_python_processes() -> None:
    """A CPU build takes the vector ISA from the CPU's flags (True: the base ISA is not proven by loading compiled
    headers in a new Python process, most of its ISA probe on the CPU); a CUDA build takes none (False: every
    check, the extensions' too, is skipped), since its compiling processes waited on those checks side by side
    and it has no CPU kernels to vectorize."""
    for graph in ("prefill", "decode_b1", "paged"):
        assert inductor_configs("default", "cpu", graph)["cpp.vec_isa_ok"] is True
        assert inductor_configs("default", "cuda", graph)["cpp.vec_isa_ok"] is False
