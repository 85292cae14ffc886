"""trtbuild's kernels compiled for Hopper with the PDL wait (trtbuild/kernels/grid_dependency.py), without a
GPU: Triton compiles to PTX for sm_90 here, and Inductor's analysis of which tensors a kernel writes runs
on the compiled IR. Needs Triton (torch's CUDA wheels bring it; the CPU wheel does not: skipped there)."""

from __future__ import annotations

import collections
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch

triton = pytest.importorskip("triton")


@pytest.fixture
def hopper_target() -> Iterator[None]:
    """Triton's active driver, answering sm_90 as the current target (nothing is launched)."""
    from triton.backends.compiler import GPUTarget

    from trtbuild.kernels import decode_matmul

    if not isinstance(decode_matmul._decode_matmul_kernel, triton.JITFunction):
        # tests/test_kernels.py imported the kernels first, under TRITON_INTERPRET=1: nothing to compile
        pytest.skip("the kernels were loaded for Triton's interpreter in this process; run this file on its own")

    class Target:
        def get_current_target(self) -> Any:
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

    before = triton.runtime.driver._active  # None until first used (and no driver is active on a CPU machine)
    triton.runtime.driver.set_active(Target())
    try:
        yield
    finally:
        triton.runtime.driver._active = before


def matmul_args(pdl: bool) -> dict[str, Any]:
    bf = torch.bfloat16
    x, w, y = torch.zeros(1, 64, dtype=bf), torch.zeros(32, 64, dtype=bf), torch.zeros(1, 32, dtype=bf)
    return dict(x_ptr=x, w_ptr=w, y_ptr=y, g_ptr=w, r_ptr=w, M=1, N=32, K=64, stride_xm=64, stride_wn=64, stride_ym=32,
                stride_rm=0, BLOCK_M=1, BLOCK_N=8, BLOCK_K=256, USE_DOT=False, EVEN_K=True, NORM=False, GAIN=False, EPS=0.0,
                GATE=False, RESIDUAL=False, PDL=pdl, SPLIT=1, K_SLICE=0)


def attention_args(pdl: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    bf = torch.bfloat16
    kc, pos = torch.zeros(1, 2, 48, 16, dtype=bf), torch.zeros(1, dtype=torch.long)
    o, ml = torch.zeros(2, 4, 16, 16), torch.zeros(2, 4, 16, 2)
    partial = dict(q_ptr=torch.zeros(1, 1, 128, dtype=bf), rope_ptr=torch.zeros(48, 8, 2), k_ptr=kc, v_ptr=kc.clone(),
                   pos_ptr=pos, slot_ptr=pos.clone(), o_ptr=o, ml_ptr=ml, KV=2, stride_qb=128, stride_qh=16, stride_kb=1536, stride_kh=768,
                   stride_ks=16, stride_vb=1536, stride_vh=768, stride_vs=16, REP=2, BLOCK_R=16, D=16, BLOCK_S=32,
                   SPLITS=4, SCALE=0.25, ROPE=True, PDL=pdl)
    merge = dict(o_ptr=o, ml_ptr=ml, y_ptr=torch.zeros(1, 1, 4, 16, dtype=bf), pos_ptr=pos, KV=2, stride_yb=64,
                 stride_yh=16, REP=2, BLOCK_R=16, D=16, SPLITS=4, BLOCK_S=32, PDL=pdl)
    return partial, merge


def kernels(pdl: bool) -> list[tuple[Any, dict[str, Any]]]:
    from trtbuild.kernels import decode_attention as da
    from trtbuild.kernels import decode_matmul as dm

    partial, merge = attention_args(pdl)
    # split-K: the matmul writes fp32 partial sums ([2, M, N]), the reduce kernel adds them up into y
    parts = torch.zeros(2, 32)
    split = matmul_args(pdl) | {"y_ptr": parts, "K": 512, "EVEN_K": True, "SPLIT": 2, "K_SLICE": 256}
    reduce = dict(p_ptr=parts, y_ptr=torch.zeros(1, 32, dtype=torch.bfloat16), MN=32, SPLIT=2, BLOCK=1024, PDL=pdl)
    return [(dm._decode_matmul_kernel, matmul_args(pdl)), (da._decode_attention_partial, partial),
            (da._decode_attention_merge, merge), (dm._decode_matmul_kernel, split), (dm._split_reduce_kernel, reduce)]


def written(kernel: Any, kwargs: dict[str, Any]) -> list[str]:
    from torch._higher_order_ops.triton_kernel_wrap import identify_accessed_tensors

    return sorted(d.name for d in identify_accessed_tensors(kernel, kwargs, {}).read_writes.writes)


def ptx(kernel: Any, kwargs: dict[str, Any]) -> list[str]:
    """The kernel's PTX for sm_90, its tensors and the ints that are multiples of 16 marked 16-aligned, as
    Triton's launcher specializes them."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    pointer = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int64: "*i64", torch.int32: "*i32"}
    sig = {n: "constexpr" if n.isupper() else pointer[v.dtype] if isinstance(v, torch.Tensor) else "i32"
           for n, v in kwargs.items()}
    consts = {(names.index(n),): v for n, v in kwargs.items() if n.isupper()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, v in kwargs.items()
             if not n.isupper() and (isinstance(v, torch.Tensor) or v % 16 == 0) and v is not None}
    compiled = triton.compile(ASTSource(kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32))
    return [line.strip() for line in compiled.asm["ptx"].splitlines()]


WAIT = -1


def accesses(lines: list[str], kernel: str) -> list[tuple[int, str, set[int]]]:
    """(line, op, the kernel's parameters its operands derive from) for each global load and store of the
    PTX: a data-flow pass over the registers, repeated until nothing changes (loops carry values back).
    The PDL wait's zero (grid_dependency.wait_for_predecessor) counts as parameter WAIT."""
    reg = re.compile(r"%[a-z]+[0-9]+")
    param = re.compile(rf"\[{kernel}_param_([0-9]+)\]")
    parsed: list[tuple[int, str, list[str], list[str], set[int]]] = []
    for i, line in enumerate(lines):
        body = re.sub(r"^@!?%p[0-9]+\s+", "", line).rstrip(";")
        if not body or body[0] in "./${}":
            continue
        op, _, rest = body.partition(" ") if " " in body else body.partition("\t")
        rest = rest.strip()
        if op.startswith("griddepcontrol.wait"):  # "griddepcontrol.wait; mov.u32 %rN, 0;"
            parsed.append((i, op, reg.findall(rest), [], {WAIT}))
            continue
        if op.startswith(("st.", "cp.async", "bar", "bra", "red.", "griddepcontrol", "ret")):
            dst, src = "", rest
        elif rest.startswith("{"):
            dst, _, src = rest.partition("}")
        else:
            dst, _, src = rest.partition(",")
        parsed.append((i, op, reg.findall(dst), reg.findall(src), {int(n) for n in param.findall(src)}))
    deps: dict[str, set[int]] = collections.defaultdict(set)
    changed = True
    while changed:
        changed = False
        for _, _, dsts, srcs, params in parsed:
            new = set(params).union(*(deps[r] for r in srcs))
            for d in dsts:
                if not new <= deps[d]:
                    deps[d] |= new
                    changed = True
    # every register of the line: the address, and a store's value and predicate (each ties it down as well)
    return [(i, op, set().union(*(deps[r] for r in reg.findall(lines[i]))))
            for i, op, _, _, _ in parsed if op.startswith(("ld.global", "st.global"))]


def memory_ops(lines: list[str]) -> collections.Counter[str]:
    ops = (line.split()[1] if line.startswith("@") else line.split()[0] for line in lines if line)
    return collections.Counter(op for op in ops if op.startswith(("ld.global", "st.global")))


def test_the_wait_leaves_what_inductor_sees_each_kernel_write_unchanged(hopper_target: None) -> None:
    # Triton's own gdc_wait is impure assembly: Inductor would assume the kernel writes every tensor
    # it is given (the weights included) and clone them all
    for (kernel, plain), (_, waiting) in zip(kernels(False), kernels(True), strict=True):
        assert written(kernel, waiting) == written(kernel, plain), kernel.__name__
    assert written(*kernels(True)[0]) == ["y_ptr"]


def test_the_wait_comes_before_every_memory_access_and_keeps_the_vector_loads(hopper_target: None) -> None:
    for (kernel, plain), (_, waiting) in zip(kernels(False), kernels(True), strict=True):
        without, with_wait = ptx(kernel, plain), ptx(kernel, waiting)
        assert not any("griddepcontrol" in line for line in without)
        wait = next(i for i, line in enumerate(with_wait) if line.startswith("griddepcontrol.wait"))
        accesses = [i for i, line in enumerate(with_wait) if memory_ops([line])]
        assert wait < accesses[0], kernel.__name__
        # the release comes late: after the kernel's first load, before its last store
        release = [i for i, line in enumerate(with_wait) if line.startswith("griddepcontrol.launch_dependents")]
        assert release and accesses[0] < release[0] and release[-1] < accesses[-1], kernel.__name__
        assert memory_ops(with_wait) == memory_ops(without), kernel.__name__  # e.g. v4 loads stay v4


def test_every_memory_access_is_tied_to_the_wait_by_data(hopper_target: None) -> None:
    """Each global load and store's address, value or predicate derives from the wait's zero, so no compiler
    may move it above the wait: a read of what the predecessor writes must not see the old contents."""
    for kernel, args in kernels(True):
        lines = ptx(kernel, args)
        wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait"))
        found = accesses(lines, kernel.__name__)
        assert found and all(i > wait and WAIT in params for i, _, params in found), kernel.__name__
