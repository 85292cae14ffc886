"""Quality of an engine: perplexity over a text file, and agreement with another engine on prompts.

Perplexity is teacher-forced: every token of the text after the first is scored once, in windows of the
engine's max_seq_len tokens that begin half a window apart (`windows`: each window scores the tokens the one
before did not reach, with at least half a window of context once past the first; the last window ends with
the text, and a text shorter than a window is scored whole). It needs the logits of every position, which the
prefill graph does not return (only the last row goes through the LM head, for speed), so the engine gets its
scoring graph (`backends/torch/score_graph.py`): compiled on request from the engine's own model and weights,
run on the engine's device, so that its kernels' numerics are what is measured. `eager=True` scores with the
eager model (`models/llama.py`, the code every graph is exported from) over the engine's weights file instead,
on the CPU: the cross-check (the two agree within 0.5% on the CPU, tests/test_quantize.py).

`against`: the same prompts (windows of the text) through both engines' compiled graphs, greedy, and the
share of generated tokens that agree position by position; then, teacher-forced on the first engine's
tokens, the share of positions where both pick the same next token and the largest difference between
their logits (both eager, over the stored weights).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
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


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """The windows that score a text of `n` tokens: (begin, end, first scored position). Each window holds
    at most `window` tokens, the next begins `stride` later, and each scores only the positions the one before
    did not reach, so every token after the first is scored exactly once, each with at least
    window - stride tokens of context once the first window is past; the last window may be shorter (it ends
    with the text), and a text shorter than a window is one window."""
    if window < 2 or not 0 < stride <= window - 1:
        raise InputError(f"--stride: expected 1 to {window - 1} (the window less one token), got {stride}")
    out: list[tuple[int, int, int]] = []
    begin, scored = 0, 1  # the first token has no context: never scored
    while scored < n:
        end = min(begin + window, n)
        out.append((begin, end, scored))
        scored, begin = end, begin + stride
    return out


def eager_scorer(model: Any) -> Callable[[Any], Any]:
    """Every position's logits (B, T, V) of prompts (B, T) through the eager model, each prompt from position 0."""
    import torch

    def score(tokens: Any) -> Any:
        return model(tokens, torch.arange(tokens.shape[1], device=tokens.device), all_logits=True, from_start=True)
    return score


def perplexity(score: Callable[[Any], Any], ids: list[int], window: int, stride: int | None = None, batch: int = 4,
               progress: Callable[[str], None] = lambda message: None) -> dict[str, Any]:
    """exp(mean negative log-likelihood) of every token of `ids` after the first, in `windows` of `window`
    tokens `stride` apart (half a window unless given); `score` gives every position's logits of prompts
    (B, T) (`eager_scorer`, or an engine's compiled scoring graph). Windows of one length go `batch` at a time."""
    import torch
    import torch.nn.functional as F

    stride = stride or max(1, window // 2)
    if len(ids) < 2:
        raise InputError(f"--text: {len(ids)} token{'s' * (len(ids) != 1)}: nothing to score (at least 2 are needed)")
    spans = windows(len(ids), window, stride)
    groups: dict[int, list[tuple[int, int, int]]] = {}
    for span in spans:  # the full windows together, the last (shorter) one alone
        groups.setdefault(span[1] - span[0], []).append(span)
    nll, scored, done = 0.0, 0, 0
    with torch.no_grad():
        for length, members in groups.items():
            for i in range(0, len(members), batch):
                chunk = members[i:i + batch]
                rows = torch.tensor([ids[b:e] for b, e, _ in chunk], dtype=torch.long)
                logits = score(rows).float().cpu()
                for row, (b, e, first) in enumerate(chunk):
                    # position p's logits predict token p + 1: targets first..e-1 come from positions first-1..e-2
                    nll += F.cross_entropy(logits[row, first - b - 1:e - b - 1], rows[row, first - b:],
                                           reduction="sum").item()
                    scored += e - first
                done += len(chunk)
                progress(f"perplexity: {done} of {len(spans)} windows scored")
    return {"perplexity": math.exp(nll / scored), "nll": nll / scored, "tokens_scored": scored,
            "windows": len(spans), "window": window, "stride": stride}


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
             progress: Any = lambda message: None, stride: int | None = None, eager: bool = False) -> dict[str, Any]:
    """`trtbuild eval`: the engine's perplexity over `text` (through its compiled scoring graph, or with
    `eager` the eager model over its stored weights) and, with `against` (another recipe), how its greedy
    tokens and logits agree with that engine's."""
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
    stride = stride or max(1, window // 2)
    result: dict[str, Any] = {"recipe": recipe.name, "precision": recipe.precision, "engine": str(entry),
                              "text": str(text), "tokens": len(ids), "tokens_from": tokens_from}
    with session:
        if eager:
            result["scored_by"] = "eager model over the stored weights (cpu)"
            rows = min(4, len(windows(len(ids), window, stride)))
            score, batch = eager_scorer(eager_model(entry, rows, window)), rows
        else:
            from trtbuild.backends.torch import score_graph
            from trtbuild.store.local import Store

            tactics = Path((session.outcome.entry.manifest.get("tactics") or {}).get("cache") or
                           Store(engines).tactics_dir / "torch" / "score")
            result["scoring_graph"] = score_graph.attach(session.engine, session.outcome.entry.manifest, tactics,
                                                         progress)
            result["scored_by"] = f"the engine's compiled scoring graph ({session.engine.device})"
            score, batch = session.engine.score, session.engine.max_batch_size
        progress(f"perplexity over {len(ids)} tokens in windows of {window}, {stride} apart")
        result |= perplexity(score, ids, window, stride, batch, progress)
        if against is not None:
            length = min(PROMPT_LEN, recipe.shapes.max_input_len, against.shapes.max_input_len)
            new = min(NEW_TOKENS, recipe.shapes.max_seq_len - length, against.shapes.max_seq_len - length)
            prompts = prompts_from(ids, PROMPTS, length)
            progress(f"greedy tokens of {len(prompts)} prompts through {recipe.name}")
            mine = greedy(session, prompts, new, recipe.shapes.max_batch_size)
    if against is not None:
        progress(f"opening {against.name} to compare")
        other = open_session(against, engines, build=build, progress=progress)
        progress(f"greedy tokens of {len(prompts)} prompts through {against.name}")
        with other:
            theirs = greedy(other, prompts, new, against.shapes.max_batch_size)
        same = sum(a == b for x, y in zip(mine, theirs) for a, b in zip(x, y))
        progress("teacher-forced comparison of the two engines' logits (eager, over their stored weights)")
        other_model = eager_model(other.outcome.entry.path, 1, length + new)
        result["against"] = {"recipe": against.name, "precision": against.precision,
                             "engine": str(other.outcome.entry.path), "prompts": len(prompts), "prompt_len": length,
                             "new_tokens": new, "greedy_agreement": same / (len(prompts) * new),
                             **compare(eager_model(entry, 1, length + new), other_model, prompts, mine)}
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result
