"""Quantizing a model's weights at build time: round to nearest, or GPTQ for int4.

`rtn_state` and `gptq_state` turn a dense state dict (the model's fused layout) into the stored form of a
quantized engine: every Linear of the decoder layers (`QUANTIZED`) becomes `quantize.py`'s buffers; the
embedding table and the LM head stay in the compute dtype (the LM head's error lands directly on every logit,
and a tied head is the embedding table itself).

fp8 and int8 are round-to-nearest per output channel: on SmolLM2-135M that costs +0.96% and +0.30% of
perplexity (benchmarks/RESULTS.md), within their budgets. Round-to-nearest int4 costs +50%, so int4 is
calibrated by GPTQ (Frantar et al., 2022): each weight column is rounded in turn and the error it leaves is
spread over the columns not yet rounded, in proportion to the inverse Hessian H = X^T X of the layer's inputs
on the calibration text, so that the layer's output on that text, not its weights, stays close. Each group's
scale and zero are chosen when its first column is reached, by a search over shrunk ranges that minimizes the
group's rounding error weighted by each input's energy (`clipped_params`): +10.0% against +25.8% with the
group's min and max. GPTQ was chosen over AWQ's activation-aware scales because its result is stored in
exactly the round-to-nearest format (AWQ needs a per-input-channel scale folded into the previous op or kept
as one more buffer), so the decode kernel and the CPU graphs are the same for both methods.

Layers are calibrated in order, each on the outputs of the layers before it as already quantized
(the standard sequential GPTQ): one pass of the embeddings, then two passes of each layer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trtbuild.models import quantize

QUANTIZED = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")
HEAD = "output"  # the LM head's module: quantized only where the recipe asks (options.lm_head)
METHODS = ("gptq", "rtn")  # int4's; fp8 and int8 are always round to nearest
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
# int4: the Linears kept at 8 bits (int8 per output channel, round to nearest), as (layer, Linear) with layer
# "first", "last" or "all"; the most sensitive ones by GPTQ's relative output error on SmolLM2-135M
# (docs/quantization.md). Empty: every Linear in int4. Every down projection: under the default calibration
# they were SmolLM2-135M's eight largest errors, and with them at int8 and AWQ scaling int4_wo met +12% on prose,
# code, documentation and a licence (worst +8.7%), where without them it missed on all four.
INT4_KEPT_INT8: tuple[tuple[str, str], ...] = (("all", "feed_forward.w2"),)

# int4: AWQ-style input-channel scaling (Lin et al., 2023) of the Linears right after a norm (QKV after the
# attention norm, gate/up after the MLP norm): W diag(s) is quantized and the norm's gain divided by s, so the
# product is unchanged and nothing new is stored. s = (input energy)^alpha, alpha from this grid (0, no
# scaling, always tried) by the smallest round-to-nearest output error on the calibration tokens; then GPTQ.
# Empty: off.
AWQ_GRID: tuple[float, ...] = (0.25, 0.5, 0.75)


def awq_scales(w: Tensor, hessian: Tensor) -> Tensor | None:
    """Input-channel scales (K,) for `w` (N, K) under its input Hessian: the exponent of `AWQ_GRID` whose int4
    round-to-nearest of W diag(s), taken back by diag(1/s), has the smallest output error tr(dW H dW^T);
    None where no scaling (alpha 0) is best."""
    energy = torch.diag(hessian).clamp(min=1e-12).sqrt()
    wf = w.float()
    best_err, best = float("inf"), None
    for alpha in (0.0, *AWQ_GRID):
        s = energy ** alpha
        s = s / (s.max() * s.min()).sqrt()  # centred on 1, so neither W diag(s) nor the gain drifts in scale
        stored = quantize.quantize("int4", wf * s)
        dw = quantize.dequantize("int4", stored["qweight"], stored["scale"], stored["zero"], torch.float32) / s - wf
        err = float(((dw @ hessian) * dw).sum())
        if err < best_err:
            best_err, best = err, (None if alpha == 0.0 else s)
    return best


def stored_format(name: str, fmt: str, names: list[str]) -> str:
    """The format Linear `name` ("layers.<i>.<linear>", one of `names`) is stored in by an engine of format
    `fmt`: `fmt`, except int4's `INT4_KEPT_INT8`, which stay int8."""
    if fmt != "int4" or not INT4_KEPT_INT8:
        return fmt
    last = max(int(n.split(".")[1]) for n in names)
    i, linear = int(name.split(".")[1]), name.split(".", 2)[2]
    for layer, kept in INT4_KEPT_INT8:
        if linear == kept and (layer == "all" or (layer == "first" and i == 0) or (layer == "last" and i == last)):
            return "int8"
    return fmt


def quantized_names(state: dict[str, Tensor]) -> list[str]:
    """The Linear modules of `state` (the model's layout) a quantized engine stores quantized."""
    return [k.removesuffix(".weight") for k in state
            if k.startswith("layers.") and k.removesuffix(".weight").endswith(QUANTIZED) and k.endswith(".weight")]


def empty_quantized(state: dict[str, Tensor], fmt: str, head: str = "dense") -> dict[str, Tensor]:
    """`state` with each quantized Linear's weight replaced by uninitialized buffers of format `fmt` (and the LM
    head's by `head`'s, unless dense): what a compile worker exports from (a graph does not depend on the weights'
    values, only their shapes)."""
    out = dict(state)
    names = quantized_names(state)
    formats = {name: stored_format(name, fmt, names) for name in names} | ({HEAD: head} if head != "dense" else {})
    for name, stored in formats.items():
        n, k = out.pop(name + ".weight").shape
        for buf, (shape, dtype) in quantize.stored_shapes(stored, n, k).items():
            out[f"{name}.{buf}"] = torch.empty(shape, dtype=dtype)
    return out


def quantize_head(state: dict[str, Tensor], fmt: str) -> dict[str, Tensor]:
    """`state` with the LM head rounded to nearest in `fmt` (options.lm_head). A tied head's table is the
    embedding's: the embedding keeps it, dense, and the head gets a quantized copy of its own."""
    out = dict(state)
    w = out.pop(HEAD + ".weight")
    out.update({f"{HEAD}.{k}": v.cpu() for k, v in quantize.quantize(fmt, w).items()})
    return out


def rtn_state(state: dict[str, Tensor], fmt: str) -> dict[str, Tensor]:
    """Round-to-nearest of every quantized Linear (per channel for fp8/int8, per group for int4)."""
    out = dict(state)
    names = quantized_names(state)
    for name in names:
        w = out.pop(name + ".weight")
        out.update({f"{name}.{k}": v.cpu() for k, v in quantize.quantize(stored_format(name, fmt, names), w).items()})
    return out


def calibration_tokens(tokenizer: Path | None, vocab_size: int, window: int, text: str | None = None) -> Tensor:
    """(windows, window) token ids of the calibration text (`calibration_text.TEXT` unless given): through
    the model's tokenizer.json when it has one, else the text's bytes modulo the vocabulary (a synthetic
    model, whose random weights make any calibration as good as another)."""
    if text is None:
        from trtbuild.models.calibration_text import TEXT

        text = TEXT
    if tokenizer is not None:
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(tokenizer)).encode(text).ids
    else:
        ids = [b % vocab_size for b in text.encode()]
    window = min(window, len(ids))
    n = len(ids) // window
    return torch.tensor(ids[: n * window], dtype=torch.long).view(n, window)


@torch.no_grad()
def generated_tokens(model: Any, starts: Tensor, length: int, seed: int = 0) -> Tensor:
    """(len(starts), length) tokens the model writes itself, one sequence from each start token, sampled at
    temperature 1 from its full distribution (data-free calibration, as LLM-QAT's): text in the model's own
    distribution, of every kind it knows, which no shipped text covers. Seeded, so a build is repeatable.
    `model` is a dense `llama.Transformer` with at least len(starts) cache rows and `length` slots; it writes
    rows 0..len(starts)-1 of its caches."""
    n = starts.shape[0]
    device = starts.device
    g = torch.Generator(device=device).manual_seed(seed)
    out = torch.empty(n, length, dtype=torch.long, device=device)
    out[:, 0] = starts
    slots = torch.arange(n, device=device)
    for i in range(length - 1):
        pos = torch.full((n, 1), i, dtype=torch.long, device=device)
        # the span: only the slots written so far are read (a step at position i attends over 0..i)
        logits = model(out[:, i:i + 1], pos, slots=slots, span=torch.arange(i + 1, device=device)).float()
        out[:, i + 1] = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[:, 0]
    return out


@torch.no_grad()
def gptq_state(model: Any, tokens: Tensor, progress: Callable[[str], None] = lambda m: None,
               errors: dict[str, float] | None = None, fmt: str = "int4") -> dict[str, Tensor]:
    """GPTQ int4 of `model`'s decoder Linears, calibrated on `tokens` (B, T) run as B prompts. `model` is a
    dense `llama.Transformer` with at least B cache rows and T slots; its weights are overwritten with the
    dequantized result as it goes (each layer must see its predecessors quantized). Returns the quantized
    Linears' buffers by state-dict name, on the CPU. `errors`, where given, receives each Linear's relative
    output error on the calibration tokens, tr(dW H dW^T) / tr(W H W^T): how sensitive it is to int4."""
    names = [f"layers.{i}.{n}" for i, layer in enumerate(model.layers) for n, _ in layer.named_modules()
             if n.endswith(QUANTIZED)]
    layers = list(model.layers)
    calls: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def keep(i: int) -> Callable[..., None]:
        def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            calls[i] = (args, kwargs)
        return hook

    # One pass through the dense model records every layer's arguments (rope rows, positions, caches...);
    # only the hidden state (the first) changes once earlier layers are quantized.
    handles = [layer.register_forward_pre_hook(keep(i), with_kwargs=True) for i, layer in enumerate(layers)]
    positions = torch.arange(tokens.shape[1], device=tokens.device)
    try:
        model(tokens, positions, all_logits=True, from_start=True)
    finally:
        for h in handles:
            h.remove()
    x = calls[0][0][0]
    out: dict[str, Tensor] = {}
    for i, layer in enumerate(layers):
        args, kwargs = calls[i]
        linears = {name: m for name, m in layer.named_modules() if name.endswith(QUANTIZED)}
        hessians = {name: torch.zeros(m.in_features, m.in_features, device=x.device) for name, m in linears.items()}
        counts = dict.fromkeys(linears, 0)
        sites: dict[str, Any] = {}  # the norm each Linear applies at its call site, if any

        def gather(name: str) -> Callable[..., None]:
            def hook(module: Any, a: tuple[Any, ...], kw: dict[str, Any]) -> None:
                inp = a[0]
                norm = kw.get("norm")
                sites[name] = norm
                if norm is not None:  # the Linear applies its call site's norm itself: H is of what it multiplies
                    inp = norm(inp)
                rows = inp.reshape(-1, inp.shape[-1]).float()
                hessians[name] += rows.T @ rows
                counts[name] += rows.shape[0]
            return hook

        handles = [m.register_forward_pre_hook(gather(n), with_kwargs=True) for n, m in linears.items()]
        try:
            layer(x, *args[1:], **kwargs)
        finally:
            for h in handles:
                h.remove()
        for name, m in linears.items():
            kind = stored_format(f"layers.{i}.{name}", fmt, names)
            h = hessians[name] * (2.0 / counts[name])
            norm = sites.get(name)
            # only a norm that feeds this Linear alone can take the scales
            if AWQ_GRID and kind == "int4" and norm is not None and sum(n is norm for n in sites.values()) == 1:
                s = awq_scales(m.weight, h)
                if s is not None:
                    m.weight.copy_(m.weight.float() * s)
                    norm.weight.copy_(norm.weight.float() / s)
                    h = h / s[:, None] / s[None, :]
                    norm_name = next(n for n, mod in layer.named_modules() if mod is norm)
                    out[f"layers.{i}.{norm_name}.weight"] = norm.weight.detach().cpu().clone()
            stored = gptq_int4(m.weight, h) if kind == "int4" else \
                gptq_channel(m.weight, h, kind) if kind == fmt else quantize.quantize(kind, m.weight)
            back = quantize.dequantize(kind, stored["qweight"], stored["scale"], stored.get("zero"), m.weight.dtype)
            if errors is not None:
                dw = (back.float() - m.weight.float()).to(h.device)
                w = m.weight.float()
                errors[f"layers.{i}.{name}"] = float(((dw @ h) * dw).sum() / ((w @ h) * w).sum())
            m.weight.copy_(back)
            out.update({f"layers.{i}.{name}.{k}": v.cpu() for k, v in stored.items()})
        x = layer(x, *args[1:], **kwargs)
        progress(f"GPTQ: layer {i + 1} of {len(layers)} quantized")
    _GRAPHS.clear()  # the captured block loops' memory, for the build's next phases
    return out


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
                _GRAPHS.run(channel_block, W[:, i1:i2], Hinv[i1:i2, i1:i2], scale, fmt=fmt)
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
        logging.getLogger("trtbuild.models.calibrate").warning(
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
                _GRAPHS.run(int4_block, W[:, i1:i2], Hinv[i1:i2, i1:i2], importance[i1:i2], group=group, clip=clip)
            W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]
        return {"qweight": quantize.pack_int4(codes, group), "scale": scales.to(torch.bfloat16),
                "zero": zeros.to(torch.bfloat16)}
    columns = order.tolist()  # read once: a read per column would wait for the device each time
    for i1 in range(0, k, GPTQ_BLOCK):
        i2 = min(i1 + GPTQ_BLOCK, k)
        W1, E1, Hinv1 = W[:, i1:i2].clone(), torch.zeros(n, i2 - i1, device=W.device), Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = columns[i1 + i]  # the original column
            s, z = scales[:, col // group, None], zeros[:, col // group, None]
            wcol = W1[:, i:i + 1]
            q = torch.round(wcol / s + z).clamp(0, 15)
            codes[:, col] = q[:, 0].to(torch.uint8)
            err = (wcol - (q - z) * s) / Hinv1[i, i]
            W1[:, i:] -= err * Hinv1[i:i + 1, i:]
            E1[:, i:i + 1] = err
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
        wcol = W1[:, i:i + 1]
        q = torch.round(wcol / s + z).clamp(0, 15)
        codes[:, i] = q[:, 0].to(torch.uint8)
        err = (wcol - (q - z) * s) / hinv[i, i]
        W1[:, i:] -= err * hinv[i:i + 1, i:]
        E1[:, i:i + 1] = err
    return codes, scales, zeros, E1


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
            with torch.cuda.graph(graph):
                outputs = fn(*inputs, **consts)
            return inputs, graph, outputs
        except Exception as e:  # noqa: BLE001 - the eager loop computes the same, more slowly
            logging.getLogger("trtbuild.models.calibrate").warning(
                "GPTQ's %s is not captured (%s: %s); it runs eagerly", fn.__name__, type(e).__name__, e)
            return None

    def clear(self) -> None:
        self._graphs.clear()


_GRAPHS = BlockGraphs()


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
