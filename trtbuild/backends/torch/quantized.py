"""The torch backend's side of quantized engines (precisions fp8, int8_wo, int4_wo): the recipe option
that picks int4's method, the checks of what does not combine with them, and the build step that turns
the checkpoint's dense weights into the stored ones (`models/calibrate.py`, `models/quantize.py`).

What changes the numbers is in the key: the precision and options.int4_method are recipe fields, and the
formats, group sizes, calibration text and GPTQ's settings are model code, whose digest keys every engine.
"""

from __future__ import annotations

import hashlib
import io
import json
import pickle
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# options.int4_method: gptq (the default) = GPTQ calibrated on `calibration_text.TEXT`; rtn = round to
# nearest per group, the baseline (+50% perplexity on SmolLM2-135M, docs/quantization.md).
INT4_METHODS = ("gptq", "rtn")
# options.fp8_method: gptq (the default) = GPTQ per output channel, calibrated as int4 is; rtn = round to
# nearest per output channel. On SmolLM2-135M round to nearest missed fp8's +2% budget on documentation
# (+2.57%) and GPTQ held it on all four kinds of text (worst +0.95%; docs/quantization.md).
FP8_METHODS = ("gptq", "rtn")
# options.lm_head: dense (the default) = the LM head stays in the compute dtype; int8 = it is stored int8, one
# scale a row (round to nearest), and read by the quantized decode kernel. On SmolLM2-135M an int8 head alone
# cost +0.03% to +0.13% of perplexity (docs/quantization.md); Llama-3.2-1B's head is 0.53 GB of the 1.15 GB an
# int4_wo step reads in bf16, 0.26 GB in int8. A tied head gets a table of its own: the embedding stays exact
# in the compute dtype (its lookups read a few rows a step), at the cost of the int8 table's memory.
LM_HEADS = ("dense", "int8")
OPTIONS = {"int4_method": INT4_METHODS, "fp8_method": FP8_METHODS, "lm_head": LM_HEADS}
QUANTIZED_PRECISIONS = ("fp8", "int8_wo", "int4_wo")
CALIBRATION_WINDOW = 512  # tokens a calibration prompt holds; fixed, so that the shapes do not change the weights
# Data-free calibration: this many sequences of CALIBRATION_WINDOW tokens the model samples itself
# (calibrate.generated_tokens), each from a token of the calibration text, beside that text's own windows.
# The text alone is one licence: int4 held its budget on another licence and missed it on prose, code and
# documentation (docs/quantization.md has the table).
GENERATED_SEQUENCES = 8
GENERATION_SEED = 0
# The per-channel formats calibrated by GPTQ (gptq.gptq_channel) instead of rounded to nearest, unless the
# recipe's fp8_method says rtn. int8_wo met its budget rounded to nearest, so it is not calibrated.
CHANNEL_GPTQ: tuple[str, ...] = ("fp8",)


def check(recipe: Any) -> list[str]:
    """What a recipe asks of quantization that cannot be built."""
    problems = []
    if "int4_method" in recipe.options and recipe.precision != "int4_wo":
        problems.append(f"options.int4_method: only for precision int4_wo, not {recipe.precision}")
    if "fp8_method" in recipe.options and recipe.precision != "fp8":
        problems.append(f"options.fp8_method: only for precision fp8, not {recipe.precision}")
    if recipe.options.get("lm_head") in LM_HEADS[1:] and recipe.precision not in QUANTIZED_PRECISIONS:
        problems.append(f"options.lm_head: {recipe.options['lm_head']} is for a quantized precision "
                        f"({', '.join(QUANTIZED_PRECISIONS)}), not {recipe.precision}")
    return problems


def quantize_weights(state: dict[str, Any], cfg: Any, recipe: Any, tokenizer: Any, device: str,
                     progress: Any, generated_cache: Path | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint's dense `state` (the model's layout) as a quantized engine stores it, and what to
    record of how: round to nearest for fp8 and int8, GPTQ or round to nearest for int4. The tensors
    left dense are cast to bf16, the compute dtype. `generated_cache`, a folder for this checkpoint alone,
    keeps the sequences the model writes for its calibration, so its next quantized build reads them."""
    import torch

    from trtbuild.backends.torch.export import place_model
    from trtbuild.models import calibrate
    from trtbuild.models.quantize import FORMATS, group_size

    fmt = FORMATS[recipe.precision]
    stored = [k.removesuffix(".qweight") for k in state if k.endswith(".qweight")]
    # fp8 and int8: GPTQ where CHANNEL_GPTQ names the format and the recipe does not ask for rtn (never over a
    # checkpoint's own fp8 Linears)
    method = recipe.options.get("int4_method", INT4_METHODS[0]) if fmt == "int4" else \
        "gptq" if fmt in CHANNEL_GPTQ and not stored and recipe.options.get("fp8_method") != "rtn" else "rtn"
    t = time.perf_counter()
    names = calibrate.quantized_names(state)
    head = recipe.options.get("lm_head", LM_HEADS[0])
    record: dict[str, Any] = {"format": fmt, "method": method, "linears": len(names), "lm_head": head,
                              "not_quantized": "embeddings, norms, biases" + (", LM head" if head == "dense" else "")}
    if stored:  # a compressed-tensors FP8 checkpoint's Linears, taken as they are (models/compressed.py)
        record["from_checkpoint"] = {"format": "compressed-tensors fp8", "linears": len(stored)}
    if fmt == "int4" and calibrate.INT4_KEPT_INT8:
        record["kept_int8"] = [n for n in names if calibrate.stored_format(n, fmt, names) != fmt]
    if fmt == "int4":
        record["group_sizes"] = sorted({group_size(state[n + ".weight"].shape[1]) for n in names})
    if method == "gptq":
        text = calibrate.calibration_tokens(tokenizer, cfg.vocab_size, CALIBRATION_WINDOW).to(device)
        generated = GENERATED_SEQUENCES
        shapes = SimpleNamespace(max_batch_size=text.shape[0] + generated, max_input_len=text.shape[1],
                                 max_seq_len=text.shape[1])
        # GPTQ overwrites the placed model's weights as it goes; on the CPU placing does not copy, so it gets
        # copies (the caller's dense tensors stay the checkpoint's)
        model = place_model(cfg, shapes, state["tok_embeddings.weight"].dtype, device,
                            {k: v.clone() if v.device.type == device else v for k, v in state.items()})
        tokens = text
        reused = False
        if generated:
            starts = text.flatten()[torch.linspace(0, text.numel() - 1, generated, device=device).long()]
            written, reused = _generated(model, starts, text.shape[1], generated_cache, progress)
            tokens = torch.cat([text, written])
        errors: dict[str, float] = {}
        quantized = calibrate.gptq_state(model, tokens, progress, errors, fmt)
        del model
        state = {k: v for k, v in state.items() if k.removesuffix(".weight") not in names} | quantized
        record["calibration"] = {"text": "calibration_text.TEXT (Apache License 2.0)", "tokens": tokens.numel(),
                                 "generated_sequences": generated, "generation_seed": GENERATION_SEED,
                                 "generated_from_cache": reused,
                                 # the most sensitive Linears: their relative output error on the calibration
                                 "largest_errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:8]),
                                 "tokenizer": "tokenizer.json" if tokenizer is not None else "bytes"}
    else:
        state = calibrate.rtn_state(state, fmt)
    if head != "dense":  # after calibration, which runs the dense head
        state = calibrate.quantize_head(state, head)
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() and v.dtype == torch.float32 and not
                 k.endswith(".scale") else v).cpu() for k, v in state.items()}
    record["seconds"] = round(time.perf_counter() - t, 2)
    return state, record


def _generated(model: Any, starts: Any, length: int, cache: Path | None,
               progress: Any) -> tuple[Any, bool]:
    """The sequences the model writes from `starts` (calibrate.generated_tokens), and whether they were read
    from `cache`. They depend on the checkpoint (the cache folder is its own), the start tokens, their length,
    the seed, the dtype the model runs in, the device's sampler and the code: all of it names the file. On a
    2-core CPU SmolLM2-135M takes about a minute to write them, half of its fp8 calibration."""
    import torch

    from trtbuild.models import calibrate, llama
    from trtbuild.store.tactics import write_atomic

    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    # the code that samples them too: a change to the model or the sampler writes them again
    code = hashlib.sha256(b"".join(Path(m.__file__ or "").read_bytes() for m in (calibrate, llama))).hexdigest()
    what = {"starts": starts.tolist(), "length": length, "seed": GENERATION_SEED, "dtype": dtype,
            "device": starts.device.type, "code": code}
    path = None
    if cache is not None:
        digest = hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
        path = cache / f"generated-{digest}.pt"
        try:
            kept = torch.load(path, map_location=starts.device, weights_only=True)
            if kept.shape == (len(starts), length) and bool((kept[:, 0] == starts).all()):
                progress(f"calibration: the model's own {len(starts)} sequences of {length} tokens, "
                         "written by an earlier build")
                return kept, True
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError):
            pass  # absent or unreadable: written again below
    progress(f"calibration: the model writes {len(starts)} sequences of {length} tokens")
    written = calibrate.generated_tokens(model, starts, length, GENERATION_SEED)
    if path is not None:
        buffer = io.BytesIO()
        torch.save(written.cpu(), buffer)
        write_atomic(path, buffer.getvalue())
    return written, False
