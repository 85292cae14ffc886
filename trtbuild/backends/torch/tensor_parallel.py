"""Tensor-parallel engines of the torch backend: one set of AOTInductor graphs every rank loads, each
rank's weight shards, and the engine that starts the ranks and drives them together.

The model is the ordinary `models.llama.Transformer`, built with one rank's share of the config (heads,
KV heads and intermediate size divided by tp, the vocabulary split) and four of its modules given a
tensor-parallel class in place (`parallelize`): the embedding looks up the rank's slice of the vocabulary
and all-reduces; the attention output and down projections all-reduce their partial sums before the bias
and the residual; the LM head all-gathers the rank's logits. The collectives are
`torch.distributed._functional_collectives`, which export keeps as graph operations, so AOTInductor
compiles them into the graphs (the process group is looked up by name when a graph runs).

What differs between ranks is data only: the weights and the embedding's first vocabulary id (a buffer,
loaded as a constant like the weights). The graphs are therefore identical on every rank and are
exported and compiled once, in the build process, under a fake process group of tp ranks.

The running side (the ranks' processes, the engine over them) is `tp_runtime.py`, kept apart because this
module's source is part of every torch engine's key and that one's is not.

Entry layout: `engine.json` (the whole engine, `parallel: {tp, group_name}`), the graphs' folders, and
`rank<r>/` with `weights.safetensors` (the rank's shards) and an `engine.json` whose `hf_config` is the
rank's share, which `runtime.TorchEngine` loads as it loads any engine (graph paths point one folder up).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from trtbuild import parallel
from trtbuild.backends import BuildJob, BuildOutput
from trtbuild.errors import TrtbuildError
from trtbuild.models.llama import FeedForward, Linear, LlamaConfig

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn


def group() -> Any:
    """The process group the graphs' collectives run on: the default one (its name is in the graphs)."""
    return dist.group.WORLD


class VocabParallelEmbedding(nn.Embedding):
    """The rank's rows of the embedding table (`vocab_start` on): ids outside them give zeros, and the
    all-reduce sums the one rank's row that each id has."""

    vocab_start: Tensor  # (1,) int64, a persistent buffer: in the rank's weights

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return _all_reduce(x.masked_fill(~inside[..., None], 0.0))


class RowParallelLinear(Linear):
    """A projection whose input features are split across ranks: each multiplies its slice, the
    all-reduce sums them, then the whole bias and the residual are added once."""

    def forward(self, x: Tensor, norm: Any = None, gate: bool = False, residual: Tensor | None = None) -> Tensor:
        y = _all_reduce(F.linear(x, self.dense_weight(x.dtype)))
        if self.bias is not None:
            y = y + self.bias
        return y if residual is None else residual + y


class VocabParallelHead(Linear):
    """The LM head over the rank's slice of the vocabulary; the ranks' logits all-gathered, the padding
    of the last slice cut off."""

    full_vocab: int = 0

    def forward(self, x: Tensor, norm: Any = None, gate: bool = False, residual: Tensor | None = None) -> Tensor:
        local = super().forward(x, norm=norm)
        gathered = _all_gather_last(local)
        return gathered[..., : self.full_vocab]


def _all_reduce(x: Tensor) -> Tensor:
    import torch.distributed._functional_collectives as funcol

    return funcol.all_reduce(x, "sum", group())


def _all_gather_last(x: Tensor) -> Tensor:
    """(..., n) on each rank -> (..., tp * n), rank r's block r-th. Gathered along the first dimension and
    rearranged here: funcol's own gather along the last one compares the gathered first dimension with tp,
    which export turns into a guard that specializes a dynamic batch."""
    import torch.distributed._functional_collectives as funcol

    tp = dist.get_world_size(group())
    stacked = funcol.all_gather_tensor(x.contiguous(), 0, group())  # (tp * lead, n)
    lead, n = x.shape[:-1], x.shape[-1]
    return stacked.view(tp, -1, n).permute(1, 0, 2).reshape(*lead, tp * n)


def parallelize(model: Any, cfg: LlamaConfig, tp: int, rank: int) -> Any:
    """Give a Transformer built with `parallel.rank_config(cfg, tp, "shard")` its tensor-parallel modules
    (in place: the parameters keep their names, so the state dict's layout is unchanged). `cfg` is the
    whole model's."""
    emb = model.tok_embeddings
    emb.__class__ = VocabParallelEmbedding
    start = torch.tensor([rank * parallel.vocab_shard(cfg.vocab_size, tp)], dtype=torch.long, device=emb.weight.device)
    emb.register_buffer("vocab_start", start)
    model.output.__class__ = VocabParallelHead
    model.output.full_vocab = cfg.vocab_size
    for block in model.layers:
        block.attention.wo.__class__ = RowParallelLinear
        if isinstance(block.feed_forward, FeedForward):
            block.feed_forward.w2.__class__ = RowParallelLinear
    return model


def rank_model(cfg: LlamaConfig, shapes: Any, dtype: Any, device: str, state: dict[str, Tensor], tp: int,
               rank: int) -> Any:
    """Rank `rank`'s model on `device`, from the whole model's fused-layout `state`."""
    from trtbuild.backends.torch.export import place_model

    parallel.check_divisible(cfg, tp)
    model = place_model(parallel.rank_config(cfg, tp, "shard"), shapes, dtype, device,
                        parallel.shard(state, cfg, tp, rank))
    return parallelize(model, cfg, tp, rank)


@contextlib.contextmanager
def fake_group(tp: int) -> Iterator[str]:
    """A process group of `tp` ranks that runs nothing, for exporting graphs with collectives in one
    process; yields its name, which the exported collectives carry and the ranks' real group must have."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise TrtbuildError("a tensor-parallel build needs a process without a torch.distributed group "
                            "(build it from the command line, not from inside a distributed job)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        yield str(group().group_name)
    finally:
        dist.destroy_process_group()


def rank_hf_config(raw: dict[str, Any], cfg: LlamaConfig, tp: int) -> dict[str, Any]:
    """config.json of one rank's share: what `runtime.TorchEngine` sizes its KV cache and checks by
    (heads, KV heads, MLP divided; head_dim explicit; the vocabulary whole: token ids are the model's)."""
    return {**raw, "num_attention_heads": cfg.num_heads // tp, "num_key_value_heads": cfg.num_kv_heads // tp,
            "intermediate_size": cfg.intermediate_size // tp, "head_dim": cfg.head_dim}


def build(job: BuildJob, dtype: Any, device: str, save_weights: Callable[[dict[str, Any], Path], None]) -> BuildOutput:
    """Export and compile the graphs once, write every rank's shards; the entry layout is the module's."""
    from trtbuild.backends.torch import graph_cache
    from trtbuild.backends.torch.export import export_graph
    from trtbuild.backends.torch.inductor import inductor_caches, inductor_configs
    from trtbuild.models.checkpoint import convert_hf_state_dict

    recipe, shapes, tp = job.recipe, job.recipe.shapes, job.recipe.parallel.tp
    phases: dict[str, float] = {}
    t = time.perf_counter()
    folder, raw, cfg, hf = job.model.checkpoint(dtype)
    parallel.check_divisible(cfg, tp, "model.config" if job.recipe.model.kind == "synthetic" else f"{folder}/config.json")
    state = convert_hf_state_dict(hf, cfg)
    del hf
    phases["load_weights_s"] = time.perf_counter() - t - job.model.synthesized_s
    if job.model.synthesized_s:
        phases["draw_synthetic_weights_s"] = job.model.synthesized_s

    t = time.perf_counter()
    for rank in range(tp):
        shards = parallel.shard(state, cfg, tp, rank)
        shards["tok_embeddings.vocab_start"] = torch.tensor([rank * parallel.vocab_shard(cfg.vocab_size, tp)])
        if cfg.tie_word_embeddings:
            del shards["output.weight"]  # the runtime ties it to the embedding's shard, as for one rank
        (job.workdir / f"rank{rank}").mkdir(parents=True)
        save_weights(shards, job.workdir / f"rank{rank}" / "weights.safetensors")
        job.finished(job.workdir / f"rank{rank}" / "weights.safetensors")
    phases["write_weights_s"] = time.perf_counter() - t

    graphs: dict[str, dict[str, Any]] = {}
    names = ["prefill", *(f"decode_b{b}" for b in shapes.batch_buckets)]
    configs = {name: inductor_configs(recipe.tactics_level, device, name) for name in names}
    # Inductor resolves the collectives' group too, so the compile runs inside the fake group as well
    with fake_group(tp) as group_name:
        model = rank_model(cfg, shapes, dtype, device, state, tp, 0)
        del state
        t = time.perf_counter()
        for name in names:
            job.progress(f"exporting {name} (tensor parallel, {tp} ranks)")
            graphs[name] = export_graph(model, name, shapes, device, {}, "aten", "sdpa")
            graphs[name].pop("export_s")
        phases["export_s"] = time.perf_counter() - t
        del model
        t = time.perf_counter()
        with inductor_caches(job.tactics.path):
            for name, graph in graphs.items():
                job.progress(f"compiling {name} with AOTInductor (tactics: {recipe.tactics_level})")
                graph["digest"] = graph_cache.graph_digest(graph["program"], configs[name])
                graph["reused"] = graph_cache.compile_or_reuse(graph, name, configs[name], graph["digest"],
                                                               job.tactics.path, job.workdir)
                del graph["program"]
        phases["compile_s"] = time.perf_counter() - t

    engine = {"hf_config": raw, "dtype": recipe.precision, "device": device,
              "max_batch_size": shapes.max_batch_size, "max_input_len": shapes.max_input_len,
              "max_seq_len": shapes.max_seq_len, "buckets": list(shapes.batch_buckets),
              "tied_output": cfg.tie_word_embeddings, "quantization": None,
              "parallel": {"tp": tp, "group_name": group_name, "ranks": [f"rank{r}" for r in range(tp)]},
              "graphs": graphs}
    (job.workdir / "engine.json").write_text(json.dumps(engine, indent=2, sort_keys=True) + "\n")
    for rank in range(tp):
        own = {**engine, "hf_config": rank_hf_config(raw, cfg, tp),
               "parallel": {**engine["parallel"], "rank": rank},
               "graphs": {n: {**g, "so": f"../{g['so']}"} for n, g in graphs.items()}}
        (job.workdir / f"rank{rank}" / "engine.json").write_text(json.dumps(own, indent=2, sort_keys=True) + "\n")
    tactics = {"level": recipe.tactics_level, "inductor_configs": configs, "tensor_parallel": tp,
               "note": "tensor-parallel graphs use Inductor's kernels (trtbuild's decode kernels are one-GPU only)",
               "compiled_graphs_reused": [n for n, g in graphs.items() if g["reused"]], "cache": str(job.tactics.path)}
    return BuildOutput(phases=phases, tactics=tactics, extra={"graphs": list(graphs), "tp": tp})
