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
group's rounding error weighted by each input's energy (`gptq.clipped_params`): +10.0% against +25.8% with the
group's min and max. GPTQ was chosen over AWQ's activation-aware scales because its result is stored in
exactly the round-to-nearest format (AWQ needs a per-input-channel scale folded into the previous op or kept
as one more buffer), so the decode kernel and the CPU graphs are the same for both methods.

Layers are calibrated in order, each on the outputs of the layers before it as already quantized
(the standard sequential GPTQ): one pass of the embeddings, then two passes of each layer. The column loops
themselves are `gptq.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from trtbuild.models import gptq, quantize

QUANTIZED = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")
HEAD = "output"  # the LM head's module: quantized only where the recipe asks (options.lm_head)
METHODS = ("gptq", "rtn")  # int4's; fp8 and int8 are always round to nearest
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
            stored = gptq.gptq_int4(m.weight, h) if kind == "int4" else \
                gptq.gptq_channel(m.weight, h, kind) if kind == fmt else quantize.quantize(kind, m.weight)
            back = quantize.dequantize(kind, stored["qweight"], stored["scale"], stored.get("zero"), m.weight.dtype)
            if errors is not None:
                dw = (back.float() - m.weight.float()).to(h.device)
                w = m.weight.float()
                errors[f"layers.{i}.{name}"] = float(((dw @ h) * dw).sum() / ((w @ h) * w).sum())
            m.weight.copy_(back)
            out.update({f"layers.{i}.{name}.{k}": v.cpu() for k, v in stored.items()})
        x = layer(x, *args[1:], **kwargs)
        progress(f"GPTQ: layer {i + 1} of {len(layers)} quantized")
    gptq.BLOCK_GRAPHS.clear()  # the captured block loops' memory, for the build's next phases
    return out
