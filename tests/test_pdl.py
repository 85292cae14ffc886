"""Which edges of a captured decode graph become programmatic (trtbuild/backends/torch/pdl.py), against a
double of the CUDA driver: the rewrite itself runs only on a Hopper GPU (tests/test_gpu.py)."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Any

import pytest

from tests import cuda_header
from trtbuild.backends.torch import pdl
from trtbuild.backends.torch.pdl import Edge

# A decode step as captured: ATen's copy, cuBLAS, Inductor, trtbuild's kernels, a memset, an Inductor template.
NAMES = {1: "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<long>>",
         2: "nvjet_hsh_64x8_64x16_2x1_v_bz_splitK_TNT", 3: "triton_red_fused_add_mean_mul_pow_rsqrt_0",
         4: "_decode_matmul_kernel_0", 5: "_decode_attention_partial_1", 6: "_decode_attention_merge_2",
         8: "triton_tem_fused_mm_3", 9: "triton_poi_fused_index_copy_4"}
MEMSET = 7


def chain(*nodes: int) -> list[Edge]:
    return [Edge(a, b, 0, 0) for a, b in zip(nodes, nodes[1:], strict=False)]


def test_only_edges_into_kernels_that_wait_become_programmatic() -> None:
    edges = chain(1, 2, 3, 4, 5, 6, MEMSET, 9, 8, 2)
    chosen = pdl.programmatic(edges, NAMES, inductor_pdl=True)
    # not into cuBLAS (1 -> 2, 8 -> 2), nor the memset's edges, nor into Inductor's GEMM template (9 -> 8)
    assert [(e.src, e.dst) for e in chosen] == [(2, 3), (3, 4), (4, 5), (5, 6)]
    # Inductor's kernels only when the package was compiled with their wait
    assert [(e.src, e.dst) for e in pdl.programmatic(edges, NAMES, inductor_pdl=False)] == [(3, 4), (4, 5), (5, 6)]


def test_trtbuild_kernels_built_without_the_wait_keep_their_full_edges() -> None:
    edges = chain(2, 3, 4, 5, 6)
    chosen = pdl.programmatic(edges, NAMES, inductor_pdl=True, trtbuild_wait=False)
    assert [(e.src, e.dst) for e in chosen] == [(2, 3)]


def test_edges_already_programmatic_or_from_other_nodes_are_left_alone() -> None:
    edges = [Edge(2, 3, 1, 1), Edge(MEMSET, 4, 0, 0), Edge(4, 9, 0, 0)]
    assert pdl.programmatic(edges, NAMES, inductor_pdl=True) == [Edge(4, 9, 0, 0)]


def test_every_trtbuild_kernel_that_waits_for_its_predecessor_is_known_by_name() -> None:
    """A kernel compiled with the wait but missing from OWN_KERNELS runs correctly but never starts early: its edges
    stay full (the quantized matmul was such a kernel, in every layer of a quantized engine's step)."""
    import re

    from .conftest import REPO

    waiting = []
    for f in sorted((REPO / "trtbuild" / "kernels").glob("*.py")):
        src = f.read_text()
        for m in re.finditer(r"@triton\.jit\ndef (\w+)\(", src):
            rest = src[m.end():]
            end = re.search(r"\n(?:@|def |class )", rest)
            if "wait_for_predecessor()" in rest[:end.start() if end else len(rest)]:
                waiting.append(m.group(1))
    assert {"_decode_matmul_kernel", "_quant_matmul_kernel", "_split_reduce_epilogue_kernel"} <= set(waiting)
    assert set(waiting) <= set(pdl.OWN_KERNELS)


def test_a_kernel_is_known_by_its_whole_name_not_a_prefix_of_it() -> None:
    assert pdl.waits_for_predecessor("_decode_matmul_kernel", False)
    assert not pdl.waits_for_predecessor("_decode_matmul_kernelx", False)
    assert not pdl.waits_for_predecessor("triton_for_fused_0", True)


class FakeDriver(pdl.Driver):
    """The driver double: a graph as node names and edges, recording the rewrite."""

    def __init__(self, names: dict[int, str], nodes: list[int], edges: list[Edge], fail: str = "") -> None:
        self._names, self._nodes, self._edges, self.fail = names, nodes, edges, fail
        self.rewritten: list[Edge] = []

    def nodes(self, graph: int) -> list[int]:
        return self._nodes

    def kernel_name(self, node: int) -> str | None:
        return self._names.get(node)

    def edges(self, graph: int) -> list[Edge]:
        return self._edges

    def make_programmatic(self, graph: int, edges: list[Edge]) -> None:
        if self.fail:
            raise OSError(self.fail)
        self.rewritten = edges


def test_overlap_rewrites_the_chosen_edges_and_reports_what_stayed_serialized() -> None:
    drv = FakeDriver(NAMES, [*NAMES, MEMSET], chain(1, 2, 3, 4, 5, 6, MEMSET, 9))
    report = pdl.overlap(123, True, drv)
    assert [(e.src, e.dst) for e in drv.rewritten] == [(2, 3), (3, 4), (4, 5), (5, 6)]
    assert report["kernels"] == len(NAMES) and report["programmatic_edges"] == 4
    assert report["serialized_kernels"] == sorted(["void at::native::vectorized_elementwise_kernel",
                                                   NAMES[2], NAMES[8], NAMES[9]])


class Graph:
    """What torch.cuda.CUDAGraph offers the runtime: keep_graph, the raw graph, instantiate."""

    made: list["Graph"] = []

    def __init__(self, keep_graph: bool = False) -> None:
        self.keep_graph, self.instantiated = keep_graph, False
        Graph.made.append(self)

    def raw_cuda_graph(self) -> int:
        assert self.keep_graph
        return 123

    def instantiate(self) -> None:
        self.instantiated = True

    def pool(self) -> Any:
        return None


@pytest.mark.parametrize("fail", ["", "CUresult 1"])
def test_a_decoder_rewrites_its_graphs_and_recaptures_plainly_when_the_driver_refuses(
        monkeypatch: pytest.MonkeyPatch, fail: str) -> None:
    import contextlib

    import torch

    from trtbuild.backends.torch.decode_graphs import DecodeGraphs

    drv = FakeDriver(NAMES, list(NAMES), chain(2, 3, 4), fail=fail)
    monkeypatch.setattr(pdl, "Driver", lambda: drv)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda *a, **k: contextlib.nullcontext())
    Graph.made = []
    decoder = DecodeGraphs(lambda *a: (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 4)), 1, 8, "cpu",
                           {"on": True, "inductor": True, "trtbuild": True, "why": "test"})
    decoder._capture_one(8)
    if fail:  # half edited, maybe: captured again, serialized, and PDL off for the decoder's later graphs
        assert [g.keep_graph for g in Graph.made] == [True, False]
        assert decoder.pdl["on"] is False and "CUresult 1" in decoder.pdl_report["why"]
    else:
        assert [g.keep_graph for g in Graph.made] == [True] and Graph.made[0].instantiated
        assert decoder.pdl_report["programmatic_edges"] == 2 and decoder.pdl_report["on"] is True


def test_pdl_mode_follows_the_device_the_switch_and_the_packages_compile() -> None:
    from trtbuild.backends.torch.runtime import pdl_mode

    assert pdl_mode({"pdl": True}, "cpu") == {"on": False, "why": "CPU"}
    assert pdl_mode({"pdl": True}, "cuda:0", allowed=False)["on"] is False


def test_pdl_mode_takes_only_the_kernels_the_engine_says_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    from trtbuild.backends.torch.runtime import pdl_mode

    monkeypatch.setattr(pdl, "available", lambda capability: None)  # a Hopper GPU and a recent driver
    assert pdl_mode({}, "cuda:0")["on"] is False  # an engine whose kernels have no wait: never early
    both = pdl_mode({"pdl": True, "trtbuild_wait": True}, "cuda:0")
    assert both["on"] and both["inductor"] and both["trtbuild"]
    own = pdl_mode({"pdl": False, "trtbuild_wait": True}, "cuda:0")
    assert own["on"] and not own["inductor"] and own["trtbuild"]


def test_a_driver_without_an_entry_point_is_refused_as_a_failed_call_not_a_crash() -> None:
    """kernel_name falls back to an unnamed kernel (full edges) where cuKernelGetName is missing, and a
    missing edge call is an OSError, which the decoder answers by capturing serialized."""
    class Lib:
        def cuGraphNodeGetType(self, node: Any, kind: Any) -> int:
            ctypes.cast(kind, ctypes.POINTER(ctypes.c_int))[0] = pdl.KERNEL_NODE
            return 0

        def cuGraphKernelNodeGetParams_v2(self, node: Any, params: Any) -> int:
            ctypes.cast(params, ctypes.POINTER(pdl._KernelParams))[0].kern = 1  # a CUkernel, no CUfunction
            return 0

    drv = pdl.Driver(Lib())
    assert drv.kernel_name(5) == ""
    with pytest.raises(OSError, match="no cuGraphGetEdges_v2"):
        drv.edges(7)


class _GraphLib:
    """libcuda as ctypes sees it for pdl.Driver: a graph of two kernel nodes (the first named through its
    CUfunction, the second through its CUkernel) and one edge between them. Records every call."""

    NODES = (0x1000, 0x2000)

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any) -> int:
            self.calls.append((name, args))
            getattr(self, f"_{name}", lambda *a: None)(*args)
            return 0
        return call

    def _cuGraphGetNodes(self, graph: Any, nodes: Any, count: Any) -> None:
        if nodes is None:
            count._obj.value = len(self.NODES)
        else:
            nodes[:] = self.NODES

    def _cuGraphNodeGetType(self, node: Any, kind: Any) -> None:
        kind._obj.value = pdl.KERNEL_NODE

    def _cuGraphKernelNodeGetParams_v2(self, node: Any, params: Any) -> None:
        if node.value == self.NODES[0]:
            params._obj.func = 0xF0
        else:
            params._obj.kern = 0xE0

    def _cuFuncGetName(self, name: Any, func: Any) -> None:
        name._obj.value = b"_decode_matmul_kernel"

    def _cuKernelGetName(self, name: Any, kern: Any) -> None:
        name._obj.value = b"_decode_attention_partial"

    def _cuGraphGetEdges_v2(self, graph: Any, src: Any, dst: Any, data: Any, count: Any) -> None:
        if src is None:
            count._obj.value = 1
        else:
            src[0], dst[0] = self.NODES


class _OneKernelLib(_GraphLib):
    """A graph of one kernel node and no edges (a timing graph of one matrix, as the LM head's), from a
    driver that refuses arrays with a count of 0 as the H100's did (CUDA_ERROR_INVALID_VALUE, 1)."""

    NODES = (0x1000,)

    def __getattr__(self, name: str) -> Any:
        call = super().__getattr__(name)
        if name != "cuGraphGetEdges_v2":
            return call

        def edges(graph: Any, src: Any, dst: Any, data: Any, count: Any) -> int:
            call(graph, src, dst, data, count)
            return 1 if src is not None and count._obj.value == 0 else 0
        return edges

    def _cuGraphGetEdges_v2(self, graph: Any, src: Any, dst: Any, data: Any, count: Any) -> None:
        count._obj.value = 0


def test_a_graph_of_one_kernel_has_no_edges_to_rewrite() -> None:
    """The LM head's timing graph holds one kernel: the rewrite finds no edge and changes nothing, where it
    used to ask the driver for 0 edges into arrays and fail every candidate's timing of that call site."""
    lib = _OneKernelLib()
    report = pdl.overlap(0x77, inductor_pdl=False, driver=pdl.Driver(lib))
    assert report == {"kernels": 1, "programmatic_edges": 0, "serialized_kernels": ["_decode_matmul_kernel"]}
    assert [n for n, _ in lib.calls].count("cuGraphGetEdges_v2") == 1
    assert not any(n.startswith(("cuGraphAdd", "cuGraphRemove")) for n, _ in lib.calls)


# Each structure pdl.py passes to the driver, the C struct it mirrors and {its field: the C fields it covers}.
STRUCTS = {pdl._KernelParams: ("CUDA_KERNEL_NODE_PARAMS_v2",
                               {"func": ("func",), "grid": ("gridDimX", "gridDimY", "gridDimZ"),
                                "block": ("blockDimX", "blockDimY", "blockDimZ"), "shared_mem": ("sharedMemBytes",),
                                "params": ("kernelParams",), "extra": ("extra",), "kern": ("kern",), "ctx": ("ctx",)}),
           pdl._EdgeData: ("CUgraphEdgeData", {"from_port": ("from_port",), "to_port": ("to_port",), "type": ("type",),
                                               "reserved": ("reserved",)})}


@pytest.mark.parametrize("header", cuda_header.headers(), ids=lambda p: str(p.parent))
def test_every_driver_call_matches_its_prototype_in_cuda_h(header: Path) -> None:
    """The rewrite's calls into libcuda against cuda.h as a C compiler reads it (tests/cuda_header.py):
    the symbols, the argument counts, widths and pointers, the NULLs of the count queries."""
    lib = _GraphLib()
    drv = pdl.Driver(lib)
    names = drv.kernel_names(0x77)
    edges = drv.edges(0x77)
    drv.make_programmatic(0x77, edges)
    assert names == dict(zip(_GraphLib.NODES, ["_decode_matmul_kernel", "_decode_attention_partial"], strict=True))
    assert [(e.src, e.dst) for e in edges] == [_GraphLib.NODES]
    assert {n for n, _ in lib.calls} == set(re.findall(r'"(cu[A-Z]\w*)"', Path(pdl.__file__).read_text()))
    cuda_header.Header(header).check(lib.calls, {t: c for t, (c, _) in STRUCTS.items()})


@pytest.mark.parametrize("header", cuda_header.headers(), ids=lambda p: str(p.parent))
def test_the_structures_and_constants_are_laid_out_as_cuda_h_has_them(header: Path) -> None:
    """What the compiler gives for sizeof, offsetof and the enum values, against pdl.py's ctypes mirrors."""
    cuda_header.check_layouts(header, STRUCTS)
    got = cuda_header.layouts(header, {}, ["CU_GRAPH_NODE_TYPE_KERNEL", "CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC",
                                           "CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC"])
    assert got["CU_GRAPH_NODE_TYPE_KERNEL"] == pdl.KERNEL_NODE
    assert got["CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC"] == got["CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC"] == pdl.PROGRAMMATIC
