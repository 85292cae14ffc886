"""Tensor parallelism on the CPU: the sharding plan, recipe validation, and two gloo ranks whose tokens
match one rank's, eagerly and through a compiled tensor-parallel engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TINY_CONFIG, make_hf_folder, run_cli, tiny_recipe_doc, write_recipe
from trtbuild import parallel
from trtbuild.errors import InputError, RecipeError
from trtbuild.recipe import load_recipe

# Multi-head attention with tied embeddings, biases and a vocabulary that two ranks split unevenly (one
# padding row); and grouped-query attention (4 query heads on 2 KV heads) as in TINY_CONFIG.
MHA = {**TINY_CONFIG, "num_key_value_heads": 4, "vocab_size": 127, "tie_word_embeddings": True,
       "attention_bias": True, "mlp_bias": True}
GQA = dict(TINY_CONFIG)
PROMPT = [[3, 17, 90, 5, 64, 11, 2, 77], [8, 1, 120, 45, 33, 9, 100, 6]]


def _state(config: dict[str, Any], folder: Path) -> tuple[Any, dict[str, Any]]:
    import torch

    from trtbuild.models.checkpoint import convert_hf_state_dict, load_weights, read_config

    make_hf_folder(folder, config)
    _, cfg = read_config(folder)
    return cfg, convert_hf_state_dict(load_weights(folder, cfg, torch.float32), cfg)


@pytest.mark.parametrize("config", [MHA, GQA], ids=["mha-tied-bias-odd-vocab", "gqa"])
@pytest.mark.parametrize("tp", [2, 4])
def test_shards_join_back_to_the_whole_state(tmp_path: Path, config: dict[str, Any], tp: int) -> None:
    import torch

    cfg, state = _state(config, tmp_path / "model")
    if config["num_key_value_heads"] % tp:
        with pytest.raises(InputError, match="num_key_value_heads"):
            parallel.shard(state, cfg, tp, 0)
        return
    shards = [parallel.shard(state, cfg, tp, r) for r in range(tp)]
    rank_cfg = parallel.rank_config(cfg, tp, "shard")
    qkv = (rank_cfg.num_heads + 2 * rank_cfg.num_kv_heads) * cfg.head_dim
    assert shards[1]["layers.0.attention.wqkv.weight"].shape == (qkv, cfg.hidden_size)
    assert shards[1]["layers.0.feed_forward.w2.weight"].shape == (cfg.hidden_size, cfg.intermediate_size // tp)
    assert shards[0]["tok_embeddings.weight"].shape[0] == rank_cfg.vocab_size == -(-cfg.vocab_size // tp)
    # rank 1 holds the second query heads and the second KV heads, not rows that straddle q and k
    q = cfg.num_heads * cfg.head_dim // tp
    assert torch.equal(shards[1]["layers.0.attention.wqkv.weight"][:q], state["layers.0.attention.wqkv.weight"][q:2 * q])
    joined = parallel.unshard(shards, cfg)
    assert joined.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(joined[name], t), name


def test_split_plan_names_each_kind() -> None:
    assert parallel.split_of("layers.3.attention.wqkv.weight") == parallel.COLUMN_QKV
    assert parallel.split_of("layers.3.feed_forward.w13.bias") == parallel.COLUMN_GATE_UP
    assert parallel.split_of("layers.3.attention.wo.weight") == parallel.ROW
    assert parallel.split_of("layers.3.attention.wo.bias") == parallel.REPLICATE
    assert parallel.split_of("output.weight") == parallel.VOCAB
    assert parallel.split_of("layers.0.attention_norm.weight") == parallel.REPLICATE


@pytest.mark.parametrize("config,tp,field", [
    (GQA, 4, "num_key_value_heads (2)"),
    ({**GQA, "num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": 8}, 4, "num_attention_heads (6)"),
    ({**GQA, "intermediate_size": 66}, 4, "intermediate_size (66)"),
])
def test_validate_refuses_a_tp_that_does_not_split_the_model(tmp_path: Path, config: dict[str, Any], tp: int,
                                                             field: str) -> None:
    path = write_recipe(tmp_path, tiny_recipe_doc(model={"source": "synthetic", "config": config},
                                                   parallel={"tp": tp}))
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert any(p.startswith(f"parallel.tp: {tp} does not divide {field} of model.config") for p in err.value.problems), \
        err.value.problems


def test_validate_reads_a_local_folder_config(tmp_path: Path) -> None:
    make_hf_folder(tmp_path / "model", GQA)
    path = write_recipe(tmp_path, tiny_recipe_doc(model={"source": "./model"}, parallel={"tp": 4}))
    with pytest.raises(RecipeError, match=r"parallel.tp: 4 does not divide num_key_value_heads \(2\) of .*config.json"):
        load_recipe(path)


def test_validate_cli_refuses_in_one_clear_error(tmp_path: Path) -> None:
    path = write_recipe(tmp_path, tiny_recipe_doc(parallel={"tp": 4}))
    result = run_cli("validate", str(path))
    assert result.returncode == 2
    assert "parallel.tp: 4 does not divide num_key_value_heads (2) of model.config" in result.stdout + result.stderr
    assert "Traceback" not in result.stderr


def test_tp_is_in_the_key_and_one_rank_keeps_the_old_key(tmp_path: Path) -> None:
    one = load_recipe(write_recipe(tmp_path, tiny_recipe_doc(), "one.yaml"))
    explicit = load_recipe(write_recipe(tmp_path, tiny_recipe_doc(parallel={"tp": 1}), "explicit.yaml"))
    two = load_recipe(write_recipe(tmp_path, tiny_recipe_doc(parallel={"tp": 2}), "two.yaml"))
    assert "parallel" not in one.build_document() and one.build_document() == explicit.build_document()
    assert two.build_document()["parallel"] == {"tp": 2}


def test_quantized_precisions_are_refused_with_tp(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="parallel.tp: precision int8_wo is not split"):
        load_recipe(write_recipe(tmp_path, tiny_recipe_doc(precision="int8_wo", parallel={"tp": 2})))


def test_the_prefill_graph_keeps_its_batch_dynamic_under_tensor_parallelism(tmp_path: Path) -> None:
    """The gather of the logits must not make export specialize the batch (it did with funcol's own
    gather along the last dimension, for any max_batch_size above 2)."""
    import torch

    from trtbuild.backends.torch.export import export_prefill
    from trtbuild.backends.torch.tensor_parallel import fake_group, rank_model
    from trtbuild.recipe import Shapes

    cfg, state = _state(GQA, tmp_path / "model")
    with fake_group(2) as name:
        model = rank_model(cfg, Shapes(4, 16, 48, (4,)), torch.float32, "cpu", state, 2, 0)
        program = export_prefill(model, 4, 16, "cpu")
    assert "all_gather_into_tensor" in str(program.graph) and name == "0"
    assert len(program.range_constraints) >= 2  # batch and prompt length still symbols


# -- two gloo ranks ----------------------------------------------------------------------------------

def _greedy(model: Any, prompts: list[list[int]], new: int) -> tuple[list[list[int]], Any]:
    """Greedy tokens from an eager Transformer (prefill, then one decode step a token), and the prefill's logits."""
    import torch

    tokens = torch.tensor(prompts)
    b, t = tokens.shape
    slots = torch.arange(b)
    with torch.no_grad():
        logits = model(tokens, torch.arange(t), from_start=True, slots=slots)
        first_logits = logits.clone()
        out = [logits.argmax(-1)]
        for i in range(new - 1):
            logits = model(out[-1][:, None], torch.full((b, 1), t + i), slots=slots)
            out.append(logits.argmax(-1))
    return torch.stack(out, 1).tolist(), first_logits


class _EagerRank:
    """A rank's eager tensor-parallel model (built in the rank's process, on its gloo group)."""

    def __init__(self, rank: int, tp: int, folder: str) -> None:
        import torch

        from trtbuild.backends.torch.tensor_parallel import rank_model
        from trtbuild.models.checkpoint import convert_hf_state_dict, load_weights, read_config
        from trtbuild.recipe import Shapes

        _, cfg = read_config(Path(folder))
        state = convert_hf_state_dict(load_weights(Path(folder), cfg, torch.float32), cfg)
        self.model = rank_model(cfg, Shapes(2, 16, 48, (2,)), torch.float32, "cpu", state, tp, rank)

    def greedy(self, prompts: list[list[int]], new: int) -> tuple[list[list[int]], list[list[float]]]:
        tokens, logits = _greedy(self.model, prompts, new)
        return tokens, logits.tolist()


@pytest.mark.parametrize("config", [MHA, GQA], ids=["mha-tied-bias-odd-vocab", "gqa"])
def test_two_gloo_ranks_generate_the_tokens_of_one(tmp_path: Path, config: dict[str, Any]) -> None:
    import torch

    from trtbuild.backends.torch.export import place_model
    from trtbuild.recipe import Shapes

    cfg, state = _state(config, tmp_path / "model")
    reference = place_model(cfg, Shapes(2, 16, 48, (2,)), torch.float32, "cpu", state)
    want, want_logits = _greedy(reference, PROMPT, 12)
    with parallel.Ranks(2, "cpu", _EagerRank, (str(tmp_path / "model"),)) as ranks:
        results = ranks.call("greedy", PROMPT, 12)
    for tokens, logits in results:
        assert tokens == want
        assert torch.allclose(torch.tensor(logits), want_logits, atol=1e-5)


# -- a compiled tensor-parallel engine ---------------------------------------------------------------

# grouped-query attention with everything the split has to get right at once: biases, tied embeddings and a
# vocabulary two ranks split unevenly
COMPILED = {**GQA, "vocab_size": 127, "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}


def test_compiled_tp2_engine_matches_one_rank_and_reports_each_rank(tmp_path: Path) -> None:
    import torch

    from trtbuild.backends.torch.export import place_model
    from trtbuild.recipe import Shapes
    from trtbuild.runner import open_session, run_report
    from trtbuild.backends.sampling import GREEDY

    doc = tiny_recipe_doc(model={"source": "synthetic", "seed": 0, "config": COMPILED}, parallel={"tp": 2})
    path = write_recipe(tmp_path / "recipes", doc)
    recipe = load_recipe(path)
    with open_session(recipe) as session:
        entry = session.outcome.entry.path
        got = session.greedy(PROMPT, 12)
        rep = run_report(session, batch_size=1, input_len=8, output_len=6, iterations=2)
        # the slot API a server drives runs on both ranks too
        first = session.engine.prefill(1, PROMPT[1][:5], GREEDY)
        second = session.engine.decode([1], [first], [5], [GREEDY])
    assert (entry / "rank0" / "weights.safetensors").is_file() and (entry / "rank1" / "engine.json").is_file()
    assert json_of(entry / "engine.json")["parallel"]["tp"] == 2

    cfg, state = _state(COMPILED, tmp_path / "model")
    reference = place_model(cfg, Shapes(2, 16, 48, (2,)), torch.float32, "cpu", state)
    want, _ = _greedy(reference, PROMPT, 12)
    assert got == want
    assert [first, *second] == _greedy(reference, [PROMPT[1][:5]], 2)[0][0]
    par = rep["parallel"]
    assert par["tp"] == 2 and par["backend"] == "gloo" and [r["rank"] for r in par["ranks"]] == [0, 1]
    for r in [*par["ranks"], par["all"]]:
        assert r["load_s"] > 0 and r["ttft_ms"] > 0 and r["tpot_ms"] > 0 and r["allreduce_ms_per_step"] > 0
    # the engine's step is its slowest rank's: the figure of the report's main row
    assert par["all"]["tpot_ms"] == rep["tpot_ms"]["p50"] >= max(r["tpot_ms"] for r in par["ranks"])
    assert par["all"]["ttft_ms"] == rep["ttft_ms"]

    # a new process finds the engine in the store, starts its ranks itself, and prints a row a rank
    result = run_cli("run", str(path), "--no-build", "--iterations", "1")
    assert result.returncode == 0, result.stderr
    assert "cache hit" in result.stdout and "rank 1" in result.stdout and "rank all" in result.stdout
    assert "all-reduce" in result.stdout


def json_of(path: Path) -> Any:
    import json

    return json.loads(path.read_text())


class _Failing:
    """A rank object that fails where told to: the launcher must report it, not hang on the other ranks."""

    def __init__(self, rank: int, tp: int, fail_init: bool) -> None:
        if fail_init and rank == 1:
            raise InputError("rank 1 cannot start: a user's mistake")
        self.rank = rank

    def collective_then_fail(self) -> int:
        import torch
        import torch.distributed as dist

        if self.rank == 1:
            raise RuntimeError("a bug in rank 1")
        t = torch.ones(1)
        dist.all_reduce(t)  # rank 0 waits here for a rank that will never come
        return int(t.item())


def test_a_failing_rank_is_reported_and_the_others_are_stopped() -> None:
    with pytest.raises(InputError, match="rank 1 cannot start"):
        with parallel.Ranks(2, "cpu", _Failing, (True,)):
            pass
    ranks = parallel.Ranks(2, "cpu", _Failing, (False,))
    with ranks, pytest.raises(parallel.TrtbuildError, match="(?s)tensor-parallel rank 1 failed.*a bug in rank 1"):
        ranks.call("collective_then_fail")
    assert not ranks._procs  # stopped, rank 0 too, though it was waiting in the all-reduce
    # a later call (an engine closing after the failure) is refused at once, not left waiting for no rank
    with pytest.raises(parallel.TrtbuildError, match="ranks have ended"):
        ranks.call("collective_then_fail")
