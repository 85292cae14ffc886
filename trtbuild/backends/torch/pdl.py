"""Programmatic dependent launch (PDL) inside a captured decode graph.

Why: a decode step is ~170 (1B) to ~330 (8B) kernel launches, most of them 2-20 us, and the H200
profiles (benchmarks/RESULTS.md) show each one's launch, ramp and tail unhidden by the CUDA graph. With
PDL (Hopper and later) a kernel's blocks may be scheduled while its predecessor is still finishing;
the kernel then waits (`griddepcontrol.wait`) until the predecessor has completed and its writes are
visible. In a graph that is a *programmatic* edge between two kernel nodes.

AOTInductor's C++ launcher (torch 2.11 on the device, 2.13 here) launches every kernel without the PDL
attribute, so a captured step has only full edges. This module rewrites them after capture, before
the graph is instantiated: an edge between two kernel nodes becomes programmatic where the downstream
kernel is known to wait before it touches memory the upstream one writes. That is decided by kernel
name, and only two families qualify, each only where the engine spec says its kernels were compiled
with the wait:
  - trtbuild's own decode kernels (`"trtbuild_wait"`; models/grid_dependency.py), which wait before any
    load or store (a no-op when launched the ordinary way) and let their successor launch after their
    main loop (released at the top, the successor's blocks held SM slots: RESULTS.md);
  - Inductor's pointwise and reduction kernels (`"pdl"`), compiled with `triton.enable_pdl`, which places
    the wait before the first access to its predecessor's output and signals its successor only after
    that wait (the protocol Inductor's own Python launcher relies on).
Everything else (cuBLAS's GEMMs, ATen's copy kernels, memsets, Inductor's GEMM templates, which it
compiles without the wait) keeps its full edge: it never waits, so it must not start early.

Through the CUDA driver API with ctypes (libcuda ships with the driver; no extra dependency).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
PROGRAMMATIC = 1  # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC, and CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC

# trtbuild's kernels (decode_matmul.py, quant_matmul.py, decode_attention.py): each waits before its first load.
OWN_KERNELS = ("_decode_matmul_kernel", "_split_reduce_kernel", "_quant_matmul_kernel",
               "_split_reduce_epilogue_kernel", "_decode_attention_partial", "_decode_attention_merge")
# Inductor's generated pointwise, reduction and persistent-reduction kernels; not its GEMM templates
# (triton_tem_*), which Inductor compiles without the wait, nor foreach kernels (triton_for_*).
INDUCTOR_PREFIXES = ("triton_poi_", "triton_red_", "triton_per_")


def waits_for_predecessor(name: str, inductor_pdl: bool, trtbuild_wait: bool = True) -> bool:
    """Whether a kernel of this name may start before its predecessor completes (it waits itself), in a
    package whose Inductor kernels were (`inductor_pdl`) or were not compiled with the wait, and whose
    trtbuild kernels were (`trtbuild_wait`: built on Hopper or later by a trtbuild that has it)."""
    if any(name == k or name.startswith(k + "_") for k in OWN_KERNELS):
        return trtbuild_wait
    return inductor_pdl and name.startswith(INDUCTOR_PREFIXES)


@dataclass(frozen=True)
class Edge:
    src: int  # CUgraphNode handles
    dst: int
    from_port: int
    kind: int


def kernel_edges(edges: Iterable[Edge], kernel_names: dict[int, str]) -> list[Edge]:
    """The full edges from one kernel node to another: the only ones PDL can make programmatic.
    `kernel_names` maps each kernel node to its function's name (other nodes are absent)."""
    return [e for e in edges if e.kind == 0 and e.from_port == 0 and e.src in kernel_names and e.dst in kernel_names]


def programmatic(edges: Iterable[Edge], kernel_names: dict[int, str], inductor_pdl: bool,
                 trtbuild_wait: bool = True) -> list[Edge]:
    """The full edges to turn programmatic: kernel node to kernel node, into a kernel that waits."""
    return [e for e in kernel_edges(edges, kernel_names)
            if waits_for_predecessor(kernel_names[e.dst], inductor_pdl, trtbuild_wait)]


class _EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


class _KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared_mem", ctypes.c_uint), ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


class Driver:
    """The few CUDA driver entry points the rewrite needs (CUDA 12.3+ for edge data and names)."""

    def __init__(self, lib: Any = None) -> None:
        self.lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")

    def _call(self, name: str, *args: Any) -> None:
        fn = getattr(self.lib, name, None)  # a driver older than the entry point: refused like a failed call
        if fn is None:
            raise OSError(f"the CUDA driver has no {name}")
        rc = fn(*args)
        if rc != 0:
            raise OSError(f"{name} returned CUresult {rc}")

    def _listed(self, name: str, graph: int, *types: Any) -> tuple[int, list[Any]]:
        """A graph query in two calls, as the driver has them: the count (arrays NULL), then the arrays."""
        n = ctypes.c_size_t(0)
        self._call(name, ctypes.c_void_p(graph), *[None] * len(types), ctypes.byref(n))
        arrays = [(t * n.value)() for t in types]
        # A graph of one kernel (a timing graph of one matrix) has no edges, and the driver answers arrays
        # with a count of 0 with CUDA_ERROR_INVALID_VALUE (H100, driver 580; RESULTS.md).
        if n.value:
            self._call(name, ctypes.c_void_p(graph), *arrays, ctypes.byref(n))
        return n.value, arrays

    def nodes(self, graph: int) -> list[int]:
        n, (arr,) = self._listed("cuGraphGetNodes", graph, ctypes.c_void_p)
        return [int(x or 0) for x in arr[:n]]

    def kernel_name(self, node: int) -> str | None:
        """The function name of a kernel node, None for any other node (or one whose name is unreadable)."""
        kind = ctypes.c_int(-1)
        self._call("cuGraphNodeGetType", ctypes.c_void_p(node), ctypes.byref(kind))
        if kind.value != KERNEL_NODE:
            return None
        params = _KernelParams()
        name = ctypes.c_char_p()
        try:
            self._call("cuGraphKernelNodeGetParams_v2", ctypes.c_void_p(node), ctypes.byref(params))
            if params.func:
                self._call("cuFuncGetName", ctypes.byref(name), ctypes.c_void_p(params.func))
            elif params.kern:
                self._call("cuKernelGetName", ctypes.byref(name), ctypes.c_void_p(params.kern))
        except OSError:
            return ""  # a kernel, but not one we can name: it keeps its full edges
        return (name.value or b"").decode(errors="replace")

    def kernel_names(self, graph: int) -> dict[int, str]:
        """Each kernel node of `graph` and its function's name."""
        return {n: name for n in self.nodes(graph) if (name := self.kernel_name(n)) is not None}

    def edges(self, graph: int) -> list[Edge]:
        n, (src, dst, data) = self._listed("cuGraphGetEdges_v2", graph, ctypes.c_void_p, ctypes.c_void_p, _EdgeData)
        return [Edge(int(src[i] or 0), int(dst[i] or 0), data[i].from_port, data[i].type) for i in range(n)]

    def make_programmatic(self, graph: int, edges: list[Edge]) -> None:
        if not edges:
            return
        n = len(edges)
        src = (ctypes.c_void_p * n)(*[e.src for e in edges])
        dst = (ctypes.c_void_p * n)(*[e.dst for e in edges])
        full, prog = (_EdgeData * n)(), (_EdgeData * n)()
        for d in prog:
            d.from_port, d.type = PROGRAMMATIC, PROGRAMMATIC
        self._call("cuGraphRemoveDependencies_v2", ctypes.c_void_p(graph), src, dst, full, ctypes.c_size_t(n))
        self._call("cuGraphAddDependencies_v2", ctypes.c_void_p(graph), src, dst, prog, ctypes.c_size_t(n))


def overlap(graph: int, inductor_pdl: bool, driver: Driver | None = None, trtbuild_wait: bool = True) -> dict[str, Any]:
    """Rewrite a captured, not yet instantiated graph (a cudaGraph_t as an int) for PDL. Returns what was
    done: kernel nodes, edges made programmatic, and the names of the kernels left serialized."""
    drv = driver or Driver()
    names = drv.kernel_names(graph)
    chosen = programmatic(drv.edges(graph), names, inductor_pdl, trtbuild_wait)
    drv.make_programmatic(graph, chosen)
    waiting = {e.dst for e in chosen}
    serial = sorted({_short(name) for n, name in names.items() if n not in waiting})
    return {"kernels": len(names), "programmatic_edges": len(chosen), "serialized_kernels": serial}


def _short(name: str) -> str:
    """A kernel's name without C++ template arguments, for the record (cuBLAS names run to 300 chars)."""
    return name.split("<", 1)[0][:80]


def available(on_cuda: Callable[[], tuple[int, int]]) -> str | None:
    """None when PDL can be used here, else why not. `on_cuda` returns the device's compute capability."""
    major, _ = on_cuda()
    if major < 9:
        return f"compute capability {major}.x (PDL needs 9.0, Hopper, or later)"
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return f"no CUDA driver library ({e})"
    missing = [f for f in ("cuGraphGetEdges_v2", "cuGraphAddDependencies_v2", "cuGraphRemoveDependencies_v2",
                           "cuGraphKernelNodeGetParams_v2", "cuFuncGetName") if not hasattr(lib, f)]
    return f"the CUDA driver lacks {', '.join(missing)} (needs CUDA 12.3+)" if missing else None
