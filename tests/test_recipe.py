"""Recipe validation: every problem reported at once as `field.path: message`, and nothing but
`TrtbuildError` ever escapes the loader."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import REPO, TINY_CONFIG, make_hf_folder, tiny_recipe_doc, write_recipe
from trtbuild.errors import InputError, RecipeError, TrtbuildError
from trtbuild.recipe import Recipe, load_recipe, parse_recipe

RECIPE_FILES = sorted((REPO / "recipes").glob("*.yaml"))


def problems_of(doc: Any, path: Path = Path("recipe.yaml")) -> list[str]:
    with pytest.raises(RecipeError) as info:
        parse_recipe(doc, path)
    return info.value.problems


def with_config(**fields: Any) -> dict[str, Any]:
    doc = tiny_recipe_doc()
    doc["model"]["config"].update(fields)
    return doc


# -- the valid case ---------------------------------------------------------------------------------


def test_tiny_recipe_loads_into_typed_fields(tmp_path: Path) -> None:
    recipe = load_recipe(write_recipe(tmp_path, tiny_recipe_doc()))
    assert isinstance(recipe, Recipe)
    assert recipe.name == "tiny"
    assert recipe.model.kind == "synthetic" and recipe.model.config == TINY_CONFIG
    assert recipe.shapes.batch_buckets == (2,)
    assert (recipe.backend, recipe.precision, recipe.tactics_level) == ("torch", "fp32", "none")
    assert (recipe.run.batch_size, recipe.run.input_len, recipe.run.output_len) == (1, 8, 8)


def test_defaults_fill_optional_sections() -> None:
    doc = tiny_recipe_doc()
    for key in ("backend", "precision", "tactics", "run"):
        del doc[key]
    del doc["shapes"]["batch_buckets"]
    recipe = parse_recipe(doc, Path("r.yaml"))
    assert (recipe.backend, recipe.precision, recipe.tactics_level) == ("torch", "fp32", "default")
    assert recipe.shapes.batch_buckets == (recipe.shapes.max_batch_size,)


def test_batch_buckets_are_sorted() -> None:
    doc = tiny_recipe_doc()
    doc["shapes"].update(max_batch_size=4, batch_buckets=[4, 1, 2])
    assert parse_recipe(doc, Path("r.yaml")).shapes.batch_buckets == (1, 2, 4)


@pytest.mark.parametrize("path", RECIPE_FILES, ids=[p.name for p in RECIPE_FILES])
def test_every_shipped_recipe_loads(path: Path) -> None:
    import json

    recipe = load_recipe(path)
    assert recipe.path == path
    json.dumps(recipe.build_document())  # a key can be made from it


def test_shipped_recipes_exist() -> None:
    assert any(p.name == "tiny-llama.yaml" for p in RECIPE_FILES)


# -- errors: each problem by field path ---------------------------------------------------------------


def test_unknown_key_suggests_the_close_match() -> None:
    doc = tiny_recipe_doc()
    doc["shapes"]["max_batch_sise"] = doc["shapes"].pop("max_batch_size")
    problems = problems_of(doc)
    assert any(p.startswith("shapes.max_batch_sise: unknown key") and "did you mean 'max_batch_size'" in p
               for p in problems), problems
    assert "shapes.max_batch_size: required" in problems


def test_unknown_key_without_a_close_match_lists_the_known_keys() -> None:
    problems = problems_of(tiny_recipe_doc(zzz=1))
    assert any(p.startswith("zzz: unknown key; known keys: name, model") for p in problems), problems


def test_unknown_key_in_the_synthetic_config() -> None:
    problems = problems_of(with_config(hidden_sise=32))
    assert any(p.startswith("model.config.hidden_sise:") and "did you mean 'hidden_size'" in p for p in problems)


def test_every_problem_is_reported_together() -> None:
    doc = tiny_recipe_doc(precision="int3", tactics={"level": "ultra"})
    doc["shapes"].update(max_input_len=64, max_seq_len=48, batch_buckets=[1, 4])
    doc["model"]["config"].update(num_attention_heads=5, num_key_value_heads=3)
    doc["run"]["batch_sise"] = 1
    problems = problems_of(doc)
    fields = {p.split(":")[0] for p in problems}
    assert {"precision", "tactics.level", "shapes.max_input_len", "shapes.batch_buckets",
            "model.config.num_attention_heads", "model.config.num_key_value_heads", "run.batch_sise"} <= fields


def test_recipe_error_message_names_the_file_and_each_problem(tmp_path: Path) -> None:
    doc = tiny_recipe_doc(precision="int3")
    doc["shapes"]["max_input_len"] = 100
    path = write_recipe(tmp_path, doc)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    err = info.value
    assert isinstance(err, InputError) and err.exit_code == 2
    assert err.path == str(path)
    assert str(err).startswith(f"{path}: {len(err.problems)} problem(s)")
    for problem in err.problems:
        assert f"  {problem}" in str(err)


def test_max_input_len_must_not_exceed_max_seq_len() -> None:
    doc = tiny_recipe_doc()
    doc["shapes"].update(max_input_len=49, max_seq_len=48)
    assert "shapes.max_input_len: 49 exceeds shapes.max_seq_len 48" in problems_of(doc)


def test_max_input_len_may_equal_max_seq_len() -> None:
    doc = tiny_recipe_doc(run={"batch_size": 1, "input_len": 8, "output_len": 8})
    doc["shapes"].update(max_input_len=48, max_seq_len=48)
    assert parse_recipe(doc, Path("r.yaml")).shapes.max_input_len == 48


def test_batch_bucket_above_max_batch_size() -> None:
    doc = tiny_recipe_doc()
    doc["shapes"]["batch_buckets"] = [1, 3]
    assert "shapes.batch_buckets: bucket 3 exceeds shapes.max_batch_size 2" in problems_of(doc)


def test_largest_bucket_must_cover_max_batch_size() -> None:
    doc = tiny_recipe_doc()
    doc["shapes"]["batch_buckets"] = [1]
    assert any(p.startswith("shapes.batch_buckets: the largest bucket (1)") for p in problems_of(doc))


def test_bad_bucket_entries_are_named_by_index() -> None:
    doc = tiny_recipe_doc()
    doc["shapes"]["batch_buckets"] = [2, "two", 0]
    problems = problems_of(doc)
    assert "shapes.batch_buckets[1]: expected an integer, got str" in problems
    assert "shapes.batch_buckets[2]: must be >= 1, got 0" in problems


def test_repeated_buckets() -> None:
    doc = tiny_recipe_doc()
    doc["shapes"]["batch_buckets"] = [2, 2]
    assert any(p.startswith("shapes.batch_buckets: buckets repeat") for p in problems_of(doc))


def test_heads_must_divide_hidden_size() -> None:
    assert "model.config.num_attention_heads: 5 does not divide hidden_size 32" in problems_of(
        with_config(num_attention_heads=5, num_key_value_heads=5))


def test_explicit_head_dim_lifts_the_divisibility_rule() -> None:
    recipe = parse_recipe(with_config(num_attention_heads=6, num_key_value_heads=2, head_dim=8), Path("r.yaml"))
    assert recipe.model.config is not None and recipe.model.config["head_dim"] == 8


def test_kv_heads_must_divide_heads() -> None:
    assert "model.config.num_key_value_heads: 3 does not divide num_attention_heads 4" in problems_of(
        with_config(num_key_value_heads=3))


def test_odd_head_dim_is_rejected_for_rotary_embeddings() -> None:
    problems = problems_of(with_config(head_dim=7))
    assert any(p.startswith("model.config.head_dim: the head dimension 7 must be even") for p in problems)


def test_unsupported_model_type() -> None:
    assert any(p.startswith("model.config.model_type: expected one of llama, mistral, qwen2")
               for p in problems_of(with_config(model_type="gpt2")))


def test_a_config_with_a_field_missing_still_has_its_other_fields_checked() -> None:
    doc = tiny_recipe_doc()
    del doc["model"]["config"]["vocab_size"]
    doc["model"]["config"]["hidden_size"] = -3
    doc["model"]["config"]["rope_theta"] = "big"
    problems = problems_of(doc)
    assert {"model.config.vocab_size: required", "model.config.hidden_size: must be > 0, got -3",
            "model.config.rope_theta: expected a number, got str"} <= set(problems), problems


def test_missing_required_config_field_is_reported_not_raised() -> None:
    doc = tiny_recipe_doc()
    del doc["model"]["config"]["num_attention_heads"]
    assert "model.config.num_attention_heads: required" in problems_of(doc)


@pytest.mark.parametrize("scaling, field", [
    ({"rope_type": "yarn", "factor": 4.0}, "model.config.rope_scaling.rope_type"),
    ({"rope_type": "llama3", "factor": 8.0}, "model.config.rope_scaling.low_freq_factor"),
    ({"rope_type": "linear"}, "model.config.rope_scaling.factor"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 8192}, "model.config.rope_scaling.high_freq_factor"),
])
def test_rope_scaling_the_model_cannot_compute(scaling: dict[str, Any], field: str) -> None:
    assert any(p.startswith(field + ":") for p in problems_of(with_config(rope_scaling=scaling)))


def test_llama3_rope_scaling_is_accepted() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    recipe = parse_recipe(with_config(rope_scaling=scaling), Path("r.yaml"))
    assert recipe.model.config is not None and recipe.model.config["rope_scaling"] == scaling


@pytest.mark.parametrize("backend, precision", [("torch", "int4_awq"), ("torch", "int8"), ("tensorrt-llm", "fp32")])
def test_precision_must_suit_the_backend(backend: str, precision: str) -> None:
    problems = problems_of(tiny_recipe_doc(backend=backend, precision=precision))
    assert any(p.startswith("precision: expected one of") and repr(precision) in p for p in problems), problems


def test_unknown_backend() -> None:
    assert any(p.startswith("backend: expected one of torch, tensorrt-llm, tensorrt")
               for p in problems_of(tiny_recipe_doc(backend="onnxruntime")))


def test_backend_checks_its_own_options() -> None:
    assert ("options.workspace: unknown option for backend torch "
            "(known: decode_matmul, decode_attention, decode_fusion, decode_split_k, prefill_attention, "
            "int4_method, fp8_method, lm_head, moe_decode, moe_prefill, kv_cache, compile)"
            in problems_of(tiny_recipe_doc(options={"workspace": 1})))
    assert ("options.prefill_attention: expected one of auto, sdpa, cudnn, got 'flash'"
            in problems_of(tiny_recipe_doc(options={"prefill_attention": "flash"})))
    for mode in ("auto", "sdpa", "cudnn"):
        parse_recipe(tiny_recipe_doc(options={"prefill_attention": mode}), Path("r.yaml"))
    assert ("options.decode_attention: expected one of auto, aten, kernel, got 'flash'"
            in problems_of(tiny_recipe_doc(options={"decode_attention": "flash"})))
    assert ("options.decode_matmul: expected one of auto, cublas, kernel, got 'triton'"
            in problems_of(tiny_recipe_doc(options={"decode_matmul": "triton"})))
    # `kernel` chooses its launch configuration by timing, which level none turns off
    assert any(p.startswith("options.decode_matmul: 'kernel' picks its configuration by timing")
               for p in problems_of(tiny_recipe_doc(options={"decode_matmul": "kernel"}, tactics={"level": "none"})))
    for mode in ("auto", "cublas", "kernel"):
        parse_recipe(tiny_recipe_doc(options={"decode_matmul": mode}, tactics={"level": "default"}), Path("r.yaml"))
    for mode in ("auto", "aten", "kernel"):
        parse_recipe(tiny_recipe_doc(options={"decode_attention": mode}), Path("r.yaml"))
    # YAML reads a bare `off` as False: the mode is `none`, and the error says so
    assert ("options.decode_fusion: expected one of epilogue, none, got False"
            in problems_of(tiny_recipe_doc(options={"decode_fusion": False})))
    for mode in ("none", "epilogue"):
        parse_recipe(tiny_recipe_doc(options={"decode_fusion": mode}), Path("r.yaml"))
    assert ("options.decode_split_k: expected one of none, timed, got 'on'"
            in problems_of(tiny_recipe_doc(options={"decode_split_k": "on"})))
    for mode in ("none", "timed"):
        parse_recipe(tiny_recipe_doc(options={"decode_split_k": mode}), Path("r.yaml"))


def test_a_torch_recipe_without_options_builds_with_each_options_default() -> None:
    """What a build passes to its plans when the recipe names no option: epilogue fusion since the
    8B measurement of 2026-12-04 (the README's recipe section names these defaults)."""
    from trtbuild.backends.torch.backend import OPTIONS, _option

    recipe = parse_recipe(tiny_recipe_doc(), Path("r.yaml"))
    assert {name: _option(recipe, name) for name in OPTIONS} == {
        "decode_matmul": "auto", "decode_attention": "auto", "decode_fusion": "epilogue", "decode_split_k": "none",
        "prefill_attention": "auto", "int4_method": "gptq", "fp8_method": "gptq", "lm_head": "dense", "moe_decode": "aten",
        "moe_prefill": "dense", "kv_cache": "rows", "compile": "regional"}
    assert ("options.moe_decode: expected one of aten, auto, kernel, got 'triton'"
            in problems_of(tiny_recipe_doc(options={"moe_decode": "triton"})))
    unfused = parse_recipe(tiny_recipe_doc(options={"decode_fusion": "none"}), Path("r.yaml"))
    assert _option(unfused, "decode_fusion") == "none"


@pytest.mark.parametrize("options, expected", [
    ({"decode_fusion": "fused"}, "options.decode_fusion: expected one of epilogue, none, got 'fused'"),
    ({"decode_attention": "kernel-unfused"}, "options.decode_attention: expected one of auto, aten, kernel, got 'kernel-unfused'"),
    ({"decode_timing": "pdl"}, "options.decode_timing: unknown option for backend torch"),
])
def test_a_removed_mode_is_one_error_naming_its_field(options: dict[str, Any], expected: str) -> None:
    """Modes kept only for comparison are gone (their measurements stay in benchmarks/RESULTS.md): a recipe
    that still names one gets one problem, on its field, and builds nothing."""
    problems = problems_of(tiny_recipe_doc(precision="int8_wo", options=options))
    assert len(problems) == 1 and problems[0].startswith(expected), problems


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["shapes"].update(max_batch_size="2"), "shapes.max_batch_size: expected an integer, got str"),
    (lambda d: d["shapes"].update(max_batch_size=True), "shapes.max_batch_size: expected an integer, got bool"),
    (lambda d: d["shapes"].update(max_seq_len=1.5), "shapes.max_seq_len: expected an integer, got float"),
    (lambda d: d["model"]["config"].update(hidden_size="32"), "model.config.hidden_size: expected int, got str"),
    (lambda d: d["model"]["config"].update(tie_word_embeddings="no"),
     "model.config.tie_word_embeddings: expected bool, got str"),
    (lambda d: d["model"]["config"].update(rms_norm_eps=None), "model.config.rms_norm_eps: expected a number, got null"),
    (lambda d: d["model"]["config"].update(vocab_size=0), "model.config.vocab_size: must be > 0, got 0"),
    (lambda d: d["model"].update(seed=-1), "model.seed: expected a non-negative integer, got -1"),
    (lambda d: d.update(shapes=[1, 2]), "shapes: expected a mapping, got list"),
    (lambda d: d.update(run="fast"), "run: expected a mapping, got str"),
    (lambda d: d.update(options=[]), "options: expected a mapping, got list"),
    (lambda d: d.update(name="Tiny Llama"), "name: must match [a-z0-9._-]+, got 'Tiny Llama'"),
    (lambda d: d.update(name="tiny\n"), "name: must match [a-z0-9._-]+, got 'tiny\\n'"),
    (lambda d: d["run"].update(output_len=100), "run.output_len: input_len + output_len = 108 exceeds shapes.max_seq_len 48"),
    (lambda d: d["run"].update(batch_size=3), "run.batch_size: 3 exceeds shapes.max_batch_size 2"),
])
def test_wrong_types_and_values(mutate: Any, expected: str) -> None:
    doc = tiny_recipe_doc()
    mutate(doc)
    assert expected in problems_of(doc)


def test_document_that_is_not_a_mapping() -> None:
    assert problems_of(["name", "tiny"]) == ["(top level): expected a mapping, got list"]


def test_missing_sections_are_required() -> None:
    problems = problems_of({"name": "tiny"})
    assert "model: required" in problems and "shapes: required" in problems


def test_max_seq_len_within_max_position_embeddings() -> None:
    doc = with_config(max_position_embeddings=32)
    assert "shapes.max_seq_len: 48 exceeds model.config.max_position_embeddings (32)" in problems_of(doc)


def test_max_seq_len_may_exceed_the_sliding_window() -> None:
    # the layers with a window attend through a mask (models/llama.py), so a longer cache is the model's
    recipe = parse_recipe(with_config(model_type="mistral", sliding_window=32), Path("recipe.yaml"))
    assert recipe.shapes.max_seq_len == 48


def test_synthetic_needs_a_config_and_no_revision() -> None:
    doc = tiny_recipe_doc()
    doc["model"]["revision"] = "main"
    assert "model.revision: only for Hugging Face hub sources" in problems_of(doc)
    del doc["model"]["config"]
    assert "model.config: required when model.source is 'synthetic'" in problems_of(doc)


def test_source_that_is_neither_folder_nor_repo_id(tmp_path: Path) -> None:
    doc = tiny_recipe_doc(model={"source": "not a repo"})
    assert any(p.startswith("model.source: 'not a repo' is neither") for p in problems_of(doc, tmp_path / "r.yaml"))


def test_hub_source_keeps_its_revision(tmp_path: Path) -> None:
    recipe = parse_recipe(tiny_recipe_doc(model={"source": "org/model", "revision": "v1"}), tmp_path / "r.yaml")
    assert (recipe.model.kind, recipe.model.source, recipe.model.revision) == ("hub", "org/model", "v1")


def test_config_and_seed_only_for_synthetic(tmp_path: Path) -> None:
    problems = problems_of(tiny_recipe_doc(model={"source": "org/model", "seed": 1, "config": {}}), tmp_path / "r.yaml")
    assert {"model.seed: only for model.source 'synthetic'", "model.config: only for model.source 'synthetic'"} <= set(problems)


def test_unusable_source_path_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    for source in ("~no-such-user-trtbuild/model", "./" + "x" * 300):
        problems = problems_of(tiny_recipe_doc(model={"source": source}), tmp_path / "r.yaml")
        assert any(p.startswith("model.source:") for p in problems), (source, problems)


# -- files --------------------------------------------------------------------------------------------


def test_missing_recipe_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(InputError, match="recipe file not found") as info:
        load_recipe(path)
    assert str(path) in str(info.value) and info.value.exit_code == 2


def test_malformed_yaml_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("name: tiny\nmodel:\n  source: synthetic\n shapes: [1, 2\n")
    with pytest.raises(InputError) as info:
        load_recipe(path)
    message = str(info.value)
    assert message.startswith(f"{path}: malformed YAML at line 4")
    assert not isinstance(info.value, RecipeError) and info.value.exit_code == 2


@pytest.mark.parametrize("text", ["shapes: 2001-13-01\n", "name: !!timestamp x\n", "[" * 2000 + "]" * 2000])
def test_yaml_that_pyyaml_fails_to_construct_is_malformed(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(InputError, match="malformed YAML"):
        load_recipe(path)


def test_recipe_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(InputError, match="cannot read the recipe"):
        load_recipe(path)


def test_relative_local_folder_resolves_against_the_recipe_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_hf_folder(tmp_path / "models" / "tiny")
    recipe_dir = tmp_path / "recipes"
    path = write_recipe(recipe_dir, tiny_recipe_doc(model={"source": "../models/tiny"}))
    monkeypatch.chdir(tmp_path / "models")  # a cwd-relative reading would find nothing here
    recipe = load_recipe(path)
    assert recipe.model.kind == "local"
    assert recipe.model.path == (tmp_path / "models" / "tiny").resolve()


def test_bare_folder_name_next_to_the_recipe_is_local(tmp_path: Path) -> None:
    make_hf_folder(tmp_path / "org" / "tiny")  # would otherwise read as the repo id org/tiny
    recipe = load_recipe(write_recipe(tmp_path, tiny_recipe_doc(model={"source": "org/tiny"})))
    assert recipe.model.kind == "local" and recipe.model.path == (tmp_path / "org" / "tiny").resolve()


def test_home_relative_folder_expands_wherever_the_recipe_lives(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    make_hf_folder(home / "models" / "tiny")
    monkeypatch.setenv("HOME", str(home))
    recipe = load_recipe(write_recipe(tmp_path / "elsewhere", tiny_recipe_doc(model={"source": "~/models/tiny"})))
    assert recipe.model.path == (home / "models" / "tiny").resolve()


def test_local_folder_missing_or_without_config(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert any(p.startswith("model.source: model folder not found")
               for p in problems_of(tiny_recipe_doc(model={"source": "./absent"}), tmp_path / "r.yaml"))
    assert any("has no config.json" in p
               for p in problems_of(tiny_recipe_doc(model={"source": "./empty"}), tmp_path / "r.yaml"))


# -- the build document -------------------------------------------------------------------------------


def test_build_document_excludes_name_and_run_defaults() -> None:
    a = parse_recipe(tiny_recipe_doc(), Path("a/r.yaml")).build_document()
    b = parse_recipe(tiny_recipe_doc(name="other", run={"batch_size": 2, "input_len": 4, "output_len": 4}),
                     Path("b/other.yaml")).build_document()
    assert a == b
    assert "name" not in a and "run" not in a and "path" not in a and "path" not in a["model"]
    assert a["shapes"]["batch_buckets"] == [2] and a["model"]["config"] == TINY_CONFIG


def test_build_document_changes_with_engine_fields() -> None:
    base = parse_recipe(tiny_recipe_doc(), Path("r.yaml")).build_document()
    doc = tiny_recipe_doc()
    doc["shapes"]["max_seq_len"] = 40
    assert parse_recipe(doc, Path("r.yaml")).build_document() != base
    assert parse_recipe(tiny_recipe_doc(precision="bf16"), Path("r.yaml")).build_document() != base


def test_build_document_of_a_local_model_omits_where_it_lives(tmp_path: Path) -> None:
    make_hf_folder(tmp_path / "a" / "m")
    make_hf_folder(tmp_path / "b" / "n")
    docs = [load_recipe(write_recipe(tmp_path / d, tiny_recipe_doc(model={"source": s}))).build_document()
            for d, s in (("a", "./m"), ("b", "./n"))]
    assert docs[0] == docs[1]
    assert "source" not in docs[0]["model"] and "path" not in docs[0]["model"]
    assert str(tmp_path) not in repr(docs[0])


def test_build_document_is_plain_data() -> None:
    import json

    doc = parse_recipe(tiny_recipe_doc(), Path("r.yaml")).build_document()
    assert json.loads(json.dumps(doc)) == doc


# -- never anything but TrtbuildError -----------------------------------------------------------------

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["synthetic", "org/name", "./m", "~", "llama", "fp16",
                                                           "torch", "tensorrt", "max", "", "a.onnx"]))
GARBAGE = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.one_of(st.text(max_size=8), st.integers()),
                                                                        inner, max_size=4)), max_leaves=12)


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every (key, key, ...) path into nested dicts and lists."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += _paths(v, prefix + (i,))
    return out


@st.composite
def mutated_documents(draw: st.DrawFn) -> Any:
    doc: Any = tiny_recipe_doc()
    for _ in range(draw(st.integers(1, 4))):
        paths = _paths(doc)
        path = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["delete", "replace", "add"]))
        if not path:
            if action == "replace":
                doc = draw(GARBAGE)
            continue
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if action == "delete":
            del parent[path[-1]]
        elif action == "replace":
            parent[path[-1]] = draw(GARBAGE)
        elif isinstance(parent, dict):
            parent[draw(st.text(max_size=16))] = draw(GARBAGE)
    return doc


def _assert_loads_or_user_error(call: Any) -> None:
    try:
        assert isinstance(call(), Recipe)
    except TrtbuildError:
        pass


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(doc=st.one_of(mutated_documents(), GARBAGE))
def test_parse_recipe_never_raises_anything_but_trtbuild_error(tmp_path: Path, doc: Any) -> None:
    _assert_loads_or_user_error(lambda: parse_recipe(copy.deepcopy(doc), tmp_path / "r.yaml"))


YAML_TEXT = st.one_of(
    st.text(alphabet=st.sampled_from(list("abc:-[]{}!&*|>'\"#%@`,?\n\t 0123456789.~")), max_size=80),
    st.text(max_size=80),
    mutated_documents().map(lambda d: yaml.safe_dump(d, sort_keys=False)),
    # a valid recipe's text with a slice replaced: broken indentation, cut-off flows, stray tags
    st.tuples(st.integers(0, 400), st.integers(0, 40), st.text(max_size=10)).map(
        lambda t: (lambda s: s[:t[0]] + t[2] + s[t[0] + t[1]:])(yaml.safe_dump(tiny_recipe_doc(), sort_keys=False))),
    st.sampled_from(["!!python/object:os.system {}", "a: 2001-13-01", "&a [*a]", "? [1]\n: 2", "!!binary x", "%YAML 9\n---"]),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=YAML_TEXT)
def test_load_recipe_never_raises_anything_but_trtbuild_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    _assert_loads_or_user_error(lambda: load_recipe(path))
