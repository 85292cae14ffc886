"""The scoring graph: every position's logits of prompts, compiled from an engine's own model on request.

Teacher-forced perplexity (`trtbuild eval`) needs the logits of every position; the prefill graph returns only
the last one (the LM head over every row would cost a long prompt's prefill a large share of its FLOPs). So an
engine can get one more graph, `score`: the prefill's computation (the same model, prompt attention kernel and
fp8 prefill matmuls) with every row through the LM head, batch and length dynamic up to the engine's cache rows
and max_seq_len. It is exported from the loaded engine's own weights on its own device and compiled by
AOTInductor with the prefill graph's Inductor options, so what it measures is the numerics of the engine's
kernels, quantized or not.

Built on request only, by `attach` (which `trtbuild eval` calls), never by `trtbuild build`: the default build
pays nothing for it, and it is not part of the engine entry, so neither the key nor the entry's files change.
It is kept in the compiled-graph cache (`graph_cache.py`, keyed by the exported program and the options), so a
second eval of the same architecture and shapes reuses it, whatever the weights. This module is not among the
backend's build modules: it does not change what `trtbuild build` makes.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from torch import Tensor, nn

from trtbuild.errors import TrtbuildError

NAME = "score"


class Score(nn.Module):
    """Prompts (B, T) from position 0, written into cache rows `slots` (B,) -> logits (B, T, V) of every position."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: Tensor, input_pos: Tensor, slots: Tensor) -> Tensor:
        return self.model(tokens, input_pos, all_logits=True, from_start=True, slots=slots)


def export_score(model: Any, max_batch_size: int, max_seq_len: int, device: str) -> Any:
    """The scoring step exported with batch (1..max_batch_size) and length (1..max_seq_len) dynamic."""
    import torch
    from torch.export import Dim

    batch = Dim("batch", min=1, max=max_batch_size) if max_batch_size > 1 else None
    seq = Dim("seq", min=1, max=max_seq_len) if max_seq_len > 1 else None
    ex_b, ex_t = min(2, max_batch_size), min(2, max_seq_len)  # 2: export specializes sizes 0 and 1
    with torch.no_grad():
        return torch.export.export(Score(model), (torch.zeros(ex_b, ex_t, dtype=torch.long, device=device),
                                                  torch.arange(ex_t, device=device), torch.arange(ex_b, device=device)),
                                   dynamic_shapes=({0: batch, 1: seq}, {0: seq}, {0: batch}),
                                   prefer_deferred_runtime_asserts_over_guards=True)


def attach(engine: Any, manifest: dict[str, Any], tactics: Path, progress: Any = lambda message: None) -> dict[str, Any]:
    """Give an open torch engine (`runtime.TorchEngine`) its scoring graph: from the compiled-graph cache under
    `tactics` when this program was compiled before, else exported and compiled now (minutes on a CPU) and
    kept there. Returns what was done: {"reused", "export_s", "compile_s"}."""
    from trtbuild.backends.torch import graph_cache
    from trtbuild.backends.torch.export import fp8_prefill, place_model
    from trtbuild.backends.torch.inductor import inductor_caches
    from trtbuild.backends.torch.prefill_attention import routed
    from trtbuild.models.llama import LlamaConfig

    spec = engine.spec
    if engine.device.startswith("cuda") and spec.get("norm_gains_folded"):
        # its weights are the folded ones, which the model placed here would need to be told about
        raise TrtbuildError("eval: a scoring graph of an engine built with options.decode_fusion fused is not supported",
                            hint="score an engine built with decode_fusion epilogue or none")
    device = "cuda" if engine.device.startswith("cuda") else "cpu"
    prefill = spec["graphs"]["prefill"]
    configs = dict((manifest.get("tactics") or {}).get("inductor_configs", {}).get("prefill", {}))
    t = time.perf_counter()
    progress("exporting the scoring graph (every position's logits)")
    weights = {k.removeprefix("model."): v for k, v in engine.constants().items()
               if not k.startswith(("model.k_cache_", "model.v_cache_")) and k != "model.rope"}
    shapes = SimpleNamespace(max_batch_size=spec["max_batch_size"], max_seq_len=spec["max_seq_len"])
    model = place_model(LlamaConfig.from_hf(spec["hf_config"]), shapes, weights["tok_embeddings.weight"].dtype,
                        engine.device, weights)
    with routed(model, prefill.get("prefill_attention", "sdpa")), fp8_prefill(model, device):
        program = export_score(model, spec["max_batch_size"], spec["max_seq_len"], engine.device)
    del model
    export_s = time.perf_counter() - t
    digest = graph_cache.graph_digest(program, configs)
    folder = graph_cache.cached(tactics, digest).parent
    reused = (folder / "COMPLETE").is_file()
    t = time.perf_counter()
    if not reused:
        progress("compiling the scoring graph with AOTInductor (once for this architecture and shapes)")
        work = Path(tempfile.mkdtemp(prefix="trtbuild-score-"))
        try:
            with inductor_caches(tactics):
                graph_cache.compile_or_reuse({"program": program}, NAME, configs, digest, tactics, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    so = folder / (folder / "COMPLETE").read_text().strip()
    engine.attach_graph(NAME, so)
    return {"reused": reused, "export_s": round(export_s, 2), "compile_s": round(time.perf_counter() - t, 2)}
