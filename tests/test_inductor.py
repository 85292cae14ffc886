"""The Inductor options a build passes per graph and device (backends/torch/inductor.py)."""

from __future__ import annotations

import pytest

from trtbuild.backends.torch.inductor import inductor_configs, quick_wrapper


@pytest.mark.parametrize("graph", ["prefill", "decode_b1", "decode_b8"])
def test_captured_cuda_graphs_compile_their_host_wrapper_quickly(graph: str) -> None:
    """The decode steps and the prefill are replayed from CUDA graphs, so their host wrapper is compiled at -O0
    without line tables (where this torch has the options); the paged graph, called by the host every step,
    and CPU graphs (no graph replays there) keep Inductor's defaults."""
    wanted = quick_wrapper()
    assert set(wanted) <= {"aot_inductor.compile_wrapper_opt_level", "aot_inductor.enable_line_tables"}
    assert wanted.get("aot_inductor.compile_wrapper_opt_level", "O0") == "O0"
    assert inductor_configs("default", "cuda", graph).items() >= wanted.items()
    for other in (inductor_configs("default", "cuda", "paged"), inductor_configs("default", "cpu", graph)):
        assert not set(wanted) & set(other)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_vector_isa_comes_from_the_cpus_flags_for_every_device(device: str) -> None:
    """No build process proves the CPU's vector ISAs by loading compiled headers in new Python processes: on the
    CPU that was most of its ISA probe, and a CUDA build's compiling processes waited on it side by side."""
    for graph in ("prefill", "decode_b1", "paged"):
        assert inductor_configs("default", device, graph)["cpp.vec_isa_ok"] is True
