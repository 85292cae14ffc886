"""Programmatic dependent launch from inside trtbuild's Triton kernels (the runtime side: trtbuild/backends/torch/pdl.py).

A kernel that may be scheduled before its predecessor completes must wait for it (`griddepcontrol.wait`)
before it reads or writes any memory, and may let its own successor be scheduled before it completes
(`griddepcontrol.launch_dependents`). Both are no-ops in a kernel launched the ordinary way.

Why not Triton's `gdc_wait` and `gdc_launch_dependents`: they are inline assembly marked impure, and
Inductor's analysis of a user kernel (which tensors it writes) stops at impure assembly and then
assumes the kernel writes every tensor it is given. Compiled into a decode graph, that cloned the
weights for every call and turned the graph's token output into a bf16 tensor (the H200, 2026-12-04,
2026-12-04). Here each instruction is *pure* assembly tied into the kernel's data flow: the wait returns a
zero the kernel adds to every pointer (nothing is loaded or stored before it), the release passes the
accumulator through (it comes after the main loop). Neither is removed as dead code, and the analysis
sees through both.

Lives with the model code because it changes what is built: its source is part of both kernels' keys.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import triton
import triton.language as tl


def source_digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def waits_on(device: torch.device | str) -> bool:
    """Whether trtbuild's kernels launched on `device` are compiled with the wait: a Hopper or later GPU
    (never in Triton's CPU interpreter, which has no griddepcontrol). The one test the kernels' launchers
    and the build's record of them (`trtbuild_wait` in the engine spec) share."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def wait_for_predecessor():
    """Wait until the previous kernel has completed and its writes are visible; returns an int32 zero to
    add to every pointer (the data dependency that keeps each load and store after the wait)."""
    zero = tl.inline_asm_elementwise("griddepcontrol.wait; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=True,
                                     pack=1)
    # the compiler cannot see the value; unannotated, it would lose every pointer's 16-byte alignment and
    # split the kernels' vector loads into 2-byte ones
    return tl.multiple_of(zero, 16)


@triton.jit
def release_successor(x):
    """x unchanged (an fp32 tensor the kernel computed last, e.g. its accumulator before the store),
    after letting the next kernel be scheduled. Late, not at the top: the next kernel's blocks only wait
    until this one completes, and scheduled early they would hold this kernel's SM slots while it still
    has blocks to run (on the H200 a release at the top made the 1B batch-8 decode step 10 us slower)."""
    return tl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                     is_pure=True, pack=1)
