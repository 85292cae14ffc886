"""GPTQ's column loops (Frantar et al., 2022): one weight at a time under its input Hessian, each column rounded
in turn and its rounding error spread over the columns not yet rounded, a block of 128 columns at a time.

- `gptq_channel`: fp8 or int8 with one scale per output row (fp8's default calibration);
- `gptq_int4`: int4 in groups along the input, each group's scale and zero set when its first column is
  reached, by a clipping search.

`calibrate.gptq_state` runs them layer by layer over the calibration tokens. The block loops are the same
everywhere; where they run differs. On the CPU they run in torch, on one thread. On CUDA, fp8/int8 blocks are
one Triton launch each (`kernels/gptq_block.py`, checked once a process against the torch loop), and the torch
loops are replayed from CUDA graphs (`BlockGraphs`): each gives the eager loop's numbers bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from trtbuild.models import quantize

log = logging.getLogger(__name__)

GPTQ_BLOCK = 128  # columns updated together (a multiple of every int4 group)
CHANNEL_BLOCK_KERNEL = True  # fp8/int8 GPTQ's column loop in one launch a block on CUDA (settable for probes)
GPTQ_DAMP = 0.01  # share of H's mean diagonal added to it, for a well-conditioned inverse
# columns in order of decreasing input energy (H's diagonal), the groups' parameters fixed first: off, +12.4%
# perplexity on SmolLM2-135M against +10.0% without (benchmarks/RESULTS.md)
GPTQ_ACT_ORDER = False
# each group's scale and zero, when its first column is reached, by a clipping search (`clipped_params`) instead
# of its min and max: on SmolLM2-135M +10.0% perplexity against +25.8% with min and max
GPTQ_CLIP = True
CLIP_GRID = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


def gptq_channel(w: Tensor, hessian: Tensor, fmt: str) -> dict[str, Tensor]:
    """One weight (N, K) in fp8 or int8 per output channel by GPTQ under the input Hessian (K, K): each row's
    scale as round to nearest sets it (its largest magnitude at the format's top), then each column rounded in
    turn and its error spread over the columns after it. `quantize.quantize`'s format."""
    threads = torch.get_num_threads()
    if w.device.type == "cpu":
        torch.set_num_threads(1)  # thousands of small steps: see gptq_int4
    try:
        n, k = w.shape
        W, H = w.float().clone(), hessian.float().clone()
        dead = torch.diag(H) == 0
        H[dead, dead] = 1.0
        W[:, dead] = 0.0
        scale = quantize.quantize(fmt, W)["scale"].float()
        H += torch.eye(k, device=H.device) * (GPTQ_DAMP * torch.diag(H).mean())
        Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
        codes = torch.zeros(n, k, device=W.device)
        kernel = _channel_block_kernel(W.device)
        for i1 in range(0, k, GPTQ_BLOCK):
            i2 = min(i1 + GPTQ_BLOCK, k)
            codes[:, i1:i2], E1 = kernel(W[:, i1:i2], Hinv[i1:i2, i1:i2], scale, fmt) if kernel is not None else \
                BLOCK_GRAPHS.run(channel_block, W[:, i1:i2], Hinv[i1:i2, i1:i2], scale, fmt=fmt)
            W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]
    finally:
        torch.set_num_threads(threads)
    qweight = codes.to(torch.float8_e4m3fn) if fmt == "fp8" else codes.to(torch.int8)
    return {"qweight": qweight, "scale": scale}


def channel_block(w: Tensor, hinv: Tensor, scale: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """GPTQ's column loop over one block (`gptq_block.channel_block`'s contract, in torch): the block's columns
    of `w` (N, B) rounded in turn in units of each row's `scale` (N,), each one's error divided by its diagonal
    entry of `hinv` (B, B) and spread over the columns after it. (codes, errors), both (N, B) fp32."""
    n, b = w.shape
    top = quantize.FP8_MAX if fmt == "fp8" else 127.0
    s = scale[:, None]
    W1, codes, E1 = w.clone(), torch.zeros(n, b, device=w.device), torch.zeros(n, b, device=w.device)
    for i in range(b):
        wcol = W1[:, i:i + 1]
        x = (wcol / s).clamp(-top, top)
        q = x.to(torch.float8_e4m3fn).float() if fmt == "fp8" else torch.round(x)
        codes[:, i] = q[:, 0]
        err = (wcol - q * s) / hinv[i, i]
        W1[:, i:] -= err * hinv[i:i + 1, i:]
        E1[:, i:i + 1] = err
    return codes, E1


def _channel_block_kernel(device: torch.device) -> Callable[[Tensor, Tensor, Tensor, str], tuple[Tensor, Tensor]] | None:
    """`gptq_block.channel_block` where it runs (a CUDA device, Triton importable) and gives the torch loop's
    codes on a test block (checked once a process: the kernel's first compile on a new GPU or Triton is where
    it could fail); None elsewhere, where the torch loop runs (on the CPU a launch costs little: the loop's
    time is its arithmetic)."""
    if device.type != "cuda" or not CHANNEL_BLOCK_KERNEL:
        return None
    if device.type not in _KERNEL_CHECKED:
        _KERNEL_CHECKED[device.type] = _checked_kernel(device)
    return _KERNEL_CHECKED[device.type]


_KERNEL_CHECKED: dict[str, Any] = {}


def _checked_kernel(device: torch.device) -> Callable[[Tensor, Tensor, Tensor, str], tuple[Tensor, Tensor]] | None:
    try:
        from trtbuild.kernels.gptq_block import channel_block as kernel

        g = torch.Generator(device="cpu").manual_seed(0)
        w, x = torch.randn(40, 128, generator=g), torch.randn(256, 128, generator=g)
        hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(x.T @ x / 256 + 0.01 * torch.eye(128))),
                                     upper=True)
        for fmt in ("fp8", "int8"):
            scale = w.abs().amax(dim=1) / (quantize.FP8_MAX if fmt == "fp8" else 127.0)
            want = channel_block(w, hinv, scale, fmt)[0]
            got = kernel(w.to(device), hinv.to(device), scale.to(device), fmt)[0].cpu()
            if not torch.equal(got, want):
                raise RuntimeError(f"{fmt} codes differ from the torch loop's in {int((got != want).sum())} places")
    except Exception as e:  # noqa: BLE001 - any failure means the torch loop, which is always right
        log.warning(
            "GPTQ's block kernel is not used (%s: %s); its column loop runs in torch, more slowly", type(e).__name__, e)
        return None
    return kernel


def gptq_int4(w: Tensor, hessian: Tensor, group: int | None = None) -> dict[str, Tensor]:
    """One weight (N, K) in int4 groups by GPTQ under the input Hessian (K, K); `quantize_int4`'s format.
    The group's scale and zero are set from the group's columns as they stand when its first column is
    reached (already corrected for the error of the groups before it)."""
    if w.device.type == "cpu":
        # The column loop is thousands of small ops: with several threads each waits on the others'
        # barriers, and on a loaded 2-core host a (3072, 576) weight took 73 s against 4 s with one thread.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return _gptq_int4(w, hessian, group)
        finally:
            torch.set_num_threads(threads)
    return _gptq_int4(w, hessian, group)


def _gptq_int4(w: Tensor, hessian: Tensor, group: int | None, act_order: bool | None = None,
               clip: bool | None = None) -> dict[str, Tensor]:
    act_order = GPTQ_ACT_ORDER if act_order is None else act_order  # read at the call: settable for probes
    clip = GPTQ_CLIP if clip is None else clip
    n, k = w.shape
    group = group or quantize.group_size(k)
    W = w.float().clone()
    H = hessian.float().clone()
    dead = torch.diag(H) == 0  # inputs never seen: their weights do not matter
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    if act_order:
        # every group's scale and zero fixed before the columns move (act_order visits a group's columns
        # out of order, so they cannot be read off the group as it stands)
        scales, zeros = clipped_params(W, group, torch.diag(H)) if clip else quantize.int4_params(W, group)
        order = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, order], H[order][:, order]
    H += torch.eye(k, device=H.device) * (GPTQ_DAMP * torch.diag(H).mean())
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    codes = torch.zeros(n, k, dtype=torch.uint8, device=W.device)
    if not act_order:  # the columns in order: a block of whole groups at a time (GPTQ_BLOCK is a multiple)
        scales = torch.zeros(n, k // group, device=W.device)
        zeros = torch.zeros(n, k // group, device=W.device)
        importance = torch.diag(H)
        for i1 in range(0, k, GPTQ_BLOCK):
            i2 = min(i1 + GPTQ_BLOCK, k)
            codes[:, i1:i2], scales[:, i1 // group:i2 // group], zeros[:, i1 // group:i2 // group], E1 = \
                BLOCK_GRAPHS.run(int4_block, W[:, i1:i2], Hinv[i1:i2, i1:i2], importance[i1:i2], group=group, clip=clip)
            W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]
        return {"qweight": quantize.pack_int4(codes, group), "scale": scales.to(torch.bfloat16),
                "zero": zeros.to(torch.bfloat16)}
    columns = order.tolist()  # read once: a read per column would wait for the device each time
    for i1 in range(0, k, GPTQ_BLOCK):
        i2 = min(i1 + GPTQ_BLOCK, k)
        W1, E1, Hinv1 = W[:, i1:i2].clone(), torch.zeros(n, i2 - i1, device=W.device), Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = columns[i1 + i]  # the original column
            codes[:, col] = _int4_column(W1, E1, Hinv1, i, scales[:, col // group, None], zeros[:, col // group, None])
        W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]
    return {"qweight": quantize.pack_int4(codes, group), "scale": scales.to(torch.bfloat16),
            "zero": zeros.to(torch.bfloat16)}


def int4_block(w: Tensor, hinv: Tensor, importance: Tensor, group: int, clip: bool) -> tuple[Tensor, ...]:
    """GPTQ's int4 column loop over one block of whole groups, in order: each group's scale and zero set from its
    columns as they stand when its first column is reached (a clipping search weighted by `importance`, H's
    diagonal, where `clip`), then each column rounded and its error spread over the columns after it.
    (codes (N, B) uint8, scales and zeros (N, B / group) fp32, errors (N, B) fp32); `w` is left as it was."""
    n, b = w.shape
    W1, E1 = w.clone(), torch.zeros(n, b, device=w.device)
    codes = torch.zeros(n, b, dtype=torch.uint8, device=w.device)
    scales, zeros = torch.zeros(n, b // group, device=w.device), torch.zeros(n, b // group, device=w.device)
    s = z = W1[:, :1]
    for i in range(b):
        if i % group == 0:
            s, z = (clipped_params(W1[:, i:i + group], group, importance[i:i + group]) if clip
                    else quantize.int4_params(W1[:, i:i + group], group))
            scales[:, i // group], zeros[:, i // group] = s[:, 0], z[:, 0]
        codes[:, i] = _int4_column(W1, E1, hinv, i, s, z)
    return codes, scales, zeros, E1


def _int4_column(W1: Tensor, E1: Tensor, hinv: Tensor, i: int, s: Tensor, z: Tensor) -> Tensor:
    """Column i of a block (`W1`, updated in place) rounded under its group's scale and zero (N, 1), its error
    divided by hinv[i, i] into `E1` and spread over the columns after it: its codes (N,) uint8."""
    wcol = W1[:, i:i + 1]
    q = torch.round(wcol / s + z).clamp(0, 15)
    err = (wcol - (q - z) * s) / hinv[i, i]
    W1[:, i:] -= err * hinv[i:i + 1, i:]
    E1[:, i:i + 1] = err
    return q[:, 0].to(torch.uint8)


class BlockGraphs:
    """GPTQ's torch block loops replayed from CUDA graphs, one captured a block shape: the loop is hundreds of
    small kernels a block, each launched from Python for ~10 µs in eager mode against ~2 µs of work, and a
    replay launches them all at once. The graph runs the same kernels on the same numbers, so the result is
    the eager loop's. Eager on the CPU, where `CAPTURE` is off, and where a capture fails (warned once)."""

    CAPTURE = True

    def __init__(self) -> None:
        self._graphs: dict[tuple[Any, ...], Any] = {}

    def run(self, fn: Callable[..., tuple[Tensor, ...]], *tensors: Tensor, **consts: Any) -> tuple[Tensor, ...]:
        if tensors[0].device.type != "cuda" or not self.CAPTURE:
            return fn(*tensors, **consts)
        key = (fn.__name__, tuple((tuple(t.shape), t.dtype) for t in tensors), tuple(sorted(consts.items())))
        if key not in self._graphs:
            self._graphs[key] = self._capture(fn, tensors, consts)
        captured = self._graphs[key]
        if captured is None:
            return fn(*tensors, **consts)
        inputs, graph, outputs = captured
        for into, t in zip(inputs, tensors, strict=True):
            into.copy_(t)
        graph.replay()
        return tuple(o.clone() for o in outputs)  # the next replay writes over them

    @staticmethod
    def _capture(fn: Callable[..., tuple[Tensor, ...]], tensors: tuple[Tensor, ...], consts: dict[str, Any]) -> Any:
        try:
            inputs = [t.clone() for t in tensors]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warmed outside the capture (the allocator's blocks, lazy inits)
                fn(*inputs, **consts)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # a build's other threads may use CUDA
                outputs = fn(*inputs, **consts)
            return inputs, graph, outputs
        except Exception as e:  # noqa: BLE001 - the eager loop computes the same, more slowly
            log.warning(
                "GPTQ's %s is not captured (%s: %s); it runs eagerly", fn.__name__, type(e).__name__, e)
            return None

    def clear(self) -> None:
        self._graphs.clear()


BLOCK_GRAPHS = BlockGraphs()


def clipped_params(w: Tensor, group: int, importance: Tensor) -> tuple[Tensor, Tensor]:
    """Each group's scale and zero with its range shrunk by the factor of `CLIP_GRID` that minimizes the
    group's rounding error, each column's error weighted by `importance` (H's diagonal: its input's energy)."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    imp = importance.reshape(1, k // group, group)
    best_err = torch.full((n, k // group), float("inf"), device=w.device)
    best_s, best_z = torch.zeros_like(best_err), torch.zeros_like(best_err)
    for c in CLIP_GRID:
        s, z = quantize.int4_params(w, group, c)
        q = torch.round(g / s[..., None] + z[..., None]).clamp(0, 15)
        err = (((q - z[..., None]) * s[..., None] - g) ** 2 * imp).sum(-1)
        better = err < best_err
        best_err, best_s, best_z = torch.where(better, err, best_err), torch.where(better, s, best_s), \
            torch.where(better, z, best_z)
    return best_s, best_z
