"""Quality of an engine: perplexity over a text file, and agreement with another engine on prompts.

Perplexity is teacher-forced: every position of the text is scored, so it needs the logits of every row,
which the compiled prefill graph does not return (only the last row goes through the LM head, for speed).
It is computed by the eager model (`models/llama.py`, the code every graph is exported from) over the
engine's own weights file: the stored, quantized tensors, dequantized exactly as the CPU graphs do. The
compiled graphs are tested against that eager model elsewhere (tests/test_build_run.py); what
quantization changes is in the weights, which this reads. The text is cut into windows of the engine's
max_seq_len tokens, each scored from its start (its first token has no context and is not scored).

`against`: the same prompts (windows of the text) through both engines' compiled graphs, greedy, and the
share of generated tokens that agree position by position; then, teacher-forced on the first engine's
tokens, the share of positions where both pick the same next token and the largest difference between
their logits (both eager, over the stored weights).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trtbuild.errors import InputError

PROMPTS = 8  # prompts for `against`, taken from the text at even spacing
PROMPT_LEN = 32
NEW_TOKENS = 32


def text_ids(path: Path, tokenizer: Path | None, vocab_size: int) -> tuple[list[int], str]:
    """The text file's token ids and how they were made: the model's tokenizer.json, or (a synthetic model
    has none) the text's UTF-8 bytes modulo the vocabulary."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: --text: cannot read the text file: {exc}") from None
    if tokenizer is not None:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(tokenizer)).encode(text).ids, "tokenizer.json"
    return [b % vocab_size for b in text.encode()], "bytes"


def eager_model(entry: Path, batch: int, window: int) -> Any:
    """The eager Transformer over a torch engine entry's stored weights (quantized ones as stored), on the CPU,
    with a cache for `batch` sequences of `window` tokens."""
    import torch
    from safetensors.torch import load_file

    from trtbuild.backends.torch.export import place_model
    from trtbuild.models.llama import LlamaConfig

    spec = json.loads((entry / "engine.json").read_text())
    cfg = LlamaConfig.from_hf(spec["hf_config"])
    weights = load_file(str(entry / "weights.safetensors"))
    if spec["tied_output"]:
        weights["output.weight"] = weights["tok_embeddings.weight"]
    shapes = SimpleNamespace(max_batch_size=batch, max_input_len=window, max_seq_len=window)
    with torch.no_grad():
        return place_model(cfg, shapes, weights["tok_embeddings.weight"].dtype, "cpu", weights)


def perplexity(model: Any, ids: list[int], window: int, batch: int = 4) -> dict[str, Any]:
    """exp(mean negative log-likelihood) of `ids`, in windows of `window` tokens scored from their start."""
    import torch
    import torch.nn.functional as F

    n = len(ids) // window
    if n == 0:
        raise InputError(f"--text: {len(ids)} tokens, fewer than one window of {window} (the engine's max_seq_len)")
    rows = torch.tensor(ids[: n * window], dtype=torch.long).view(n, window)
    nll, scored = 0.0, 0
    with torch.no_grad():
        for i in range(0, n, batch):
            chunk = rows[i:i + batch]
            logits = model(chunk, torch.arange(window), all_logits=True, from_start=True).float()
            nll += F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1),
                                   reduction="sum").item()
            scored += chunk[:, 1:].numel()
    return {"perplexity": math.exp(nll / scored), "nll": nll / scored, "tokens_scored": scored, "windows": n,
            "window": window}


def prompts_from(ids: list[int], count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens at even spacing through `ids`."""
    if len(ids) < length:
        raise InputError(f"--text: {len(ids)} tokens, fewer than one prompt of {length}")
    step = max(1, (len(ids) - length) // max(1, count - 1))
    return [ids[s:s + length] for s in range(0, len(ids) - length + 1, step)][:count]


def greedy(session: Any, prompts: list[list[int]], new_tokens: int, batch: int) -> list[list[int]]:
    """Greedy continuations of `prompts` through an open session's compiled engine, `batch` at a time."""
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        out += session.greedy(prompts[i:i + batch], new_tokens)
    return out


def compare(model_a: Any, model_b: Any, prompts: list[list[int]], tokens_a: list[list[int]]) -> dict[str, Any]:
    """Teacher-forced on prompt + engine A's tokens: the share of positions where A's and B's eager models
    pick the same next token, and the largest logit difference between them."""
    import torch

    seqs = torch.tensor([p + t for p, t in zip(prompts, tokens_a)], dtype=torch.long)
    agree, total, largest = 0, 0, 0.0
    with torch.no_grad():
        for row in seqs:  # one at a time: the eager models were placed with a cache of one row
            pos = torch.arange(row.shape[0])
            a = model_a(row[None], pos, all_logits=True, from_start=True).float()[0, len(prompts[0]) - 1:-1]
            b = model_b(row[None], pos, all_logits=True, from_start=True).float()[0, len(prompts[0]) - 1:-1]
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += a.shape[0]
            largest = max(largest, float((a - b).abs().max()))
    return {"teacher_forced_agreement": agree / total, "max_logit_diff": largest, "positions": total}


def evaluate(recipe: Any, text: Path, engines: Any = None, against: Any = None, build: bool = True,
             progress: Any = lambda message: None) -> dict[str, Any]:
    """`trtbuild eval`: the engine's perplexity over `text` and, with `against` (another recipe), how its
    greedy tokens and logits agree with that engine's."""
    from trtbuild.runner import open_session

    for r in (recipe, against):
        if r is not None and r.backend != "torch":
            raise InputError(f"{r.path}: backend: eval reads the weights of torch engines; {r.backend} is not supported")
    t0 = time.perf_counter()
    session = open_session(recipe, engines, build=build, progress=progress)
    entry = session.outcome.entry.path
    cfg = json.loads((entry / "engine.json").read_text())["hf_config"]
    ids, tokens_from = text_ids(text, session.outcome.model.tokenizer, int(cfg["vocab_size"]))
    window = recipe.shapes.max_seq_len
    result: dict[str, Any] = {"recipe": recipe.name, "precision": recipe.precision, "engine": str(entry),
                              "text": str(text), "tokens": len(ids), "tokens_from": tokens_from}
    progress(f"perplexity over {len(ids)} tokens in windows of {window}")
    rows = min(4, max(1, len(ids) // window))
    result |= perplexity(eager_model(entry, rows, window), ids, window, rows)
    if against is not None:
        other = open_session(against, engines, build=build, progress=progress)
        length = min(PROMPT_LEN, recipe.shapes.max_input_len, against.shapes.max_input_len)
        new = min(NEW_TOKENS, recipe.shapes.max_seq_len - length, against.shapes.max_seq_len - length)
        prompts = prompts_from(ids, PROMPTS, length)
        progress(f"greedy tokens of {len(prompts)} prompts through both engines")
        with session:
            mine = greedy(session, prompts, new, recipe.shapes.max_batch_size)
        with other:
            theirs = greedy(other, prompts, new, against.shapes.max_batch_size)
        same = sum(a == b for x, y in zip(mine, theirs) for a, b in zip(x, y))
        other_model = eager_model(other.outcome.entry.path, 1, length + new)
        result["against"] = {"recipe": against.name, "precision": against.precision,
                             "engine": str(other.outcome.entry.path), "prompts": len(prompts), "prompt_len": length,
                             "new_tokens": new, "greedy_agreement": same / (len(prompts) * new),
                             **compare(eager_model(entry, 1, length + new), other_model, prompts, mine)}
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result
