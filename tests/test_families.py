"""The families beyond Llama (Qwen3, Phi-3, Gemma 2 and 3, Mixtral, Qwen3-MoE) against transformers' own
classes: tiny random models (odd sizes, GQA, tied and untied embeddings, several layers, local and global
layers both present), saved with `save_pretrained` and read back by trtbuild's loader. fp32 on the CPU:
logits within fp32 tolerance at every position and greedy tokens identical to `generate`, for prompts and
generations that cross the sliding windows. `test_compiled_*` does the same through a compiled package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch import Tensor

from trtbuild.models.checkpoint import convert_hf_state_dict, load_weights, read_config
from trtbuild.models.llama import Transformer

ATOL = RTOL = 1e-4
BATCH, PROMPT_LEN, DECODE_STEPS = 2, 11, 14
MAX_SEQ_LEN = 32
WINDOW = 5  # shorter than the prompt: local layers drop keys both in the prompt and while decoding

COMMON: dict[str, Any] = dict(hidden_size=48, intermediate_size=72, num_hidden_layers=4, num_attention_heads=6,
                              num_key_value_heads=2, vocab_size=101, max_position_embeddings=64,
                              tie_word_embeddings=False, rms_norm_eps=1e-6)
LOCAL_GLOBAL = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0,
            # original length 16 < PROMPT_LEN + DECODE_STEPS: the decode steps past it use the long factors
            "short_factor": [1.0 + 0.1 * i for i in range(4)], "long_factor": [1.5 + 0.5 * i for i in range(4)],
            "original_max_position_embeddings": 16}

# name -> (config class, model class, config fields)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 10, "rope_theta": 1e6}),
    "qwen3-tied-mqa": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8, "num_key_value_heads": 1,
                                                           "tie_word_embeddings": True}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW, "head_dim": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "phi3-longrope-window": ("Phi3Config", "Phi3ForCausalLM", {
        "hidden_size": 48, "num_attention_heads": 6, "pad_token_id": 0, "original_max_position_embeddings": 16,
        "rope_parameters": LONGROPE, "sliding_window": WINDOW}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 12, "query_pre_attn_scalar": 20, "sliding_window": WINDOW, "layer_types": LOCAL_GLOBAL,
        "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "gemma3-softcap-untied": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": WINDOW, "layer_types": LOCAL_GLOBAL,
        "final_logit_softcapping": 3.0, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 8, "query_pre_attn_scalar": 16, "sliding_window": WINDOW, "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0, "tie_word_embeddings": True, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 5, "num_experts_per_tok": 2,
                                                        "num_hidden_layers": 2}),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 10, "num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 20,
        "norm_topk_prob": False, "mlp_only_layers": [0], "num_hidden_layers": 3}),
    "qwen3-moe-normed": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
        "norm_topk_prob": True, "num_hidden_layers": 2, "tie_word_embeddings": True}),
}


def hf_model(name: str) -> Any:
    config_cls, model_cls, fields = CASES[name]
    config = getattr(transformers, config_cls)(**{**COMMON, **fields})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    _randomize(model)
    return model


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    """Every parameter random and O(1) logits (HF's init would leave norm gains untested); routers spread
    wide, so that the choice of experts is far from a tie."""
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen) + (0.0 if "gemma" in type(model).__name__.lower() else 1.0))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        elif name.endswith("gate.weight") and p.dim() == 2 and p.shape[0] < 10:  # a router
            p.copy_(3 * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def ours(folder: Path, max_seq_len: int = MAX_SEQ_LEN) -> Transformer:
    _, cfg = read_config(folder)
    model = Transformer(cfg, max_batch_size=BATCH, max_seq_len=max_seq_len, dtype=torch.float32)
    model.load_state_dict(convert_hf_state_dict(load_weights(folder, cfg, torch.float32), cfg), strict=True)
    return model.eval()


def prompts(vocab: int = 101) -> Tensor:
    return torch.randint(3, vocab, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(2))


@pytest.fixture(params=list(CASES), scope="module")
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    hf = hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, folder


@torch.no_grad()
def hf_generate(hf: Any, tokens: Tensor, steps: int = DECODE_STEPS) -> Any:
    return hf.generate(input_ids=tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=steps,
                       min_new_tokens=steps, do_sample=False, output_logits=True, return_dict_in_generate=True,
                       pad_token_id=0)


def longrope(hf: Any) -> bool:
    return (hf.config.rope_parameters or {}).get("rope_type") == "longrope"


@torch.no_grad()
def hf_reference(hf: Any, tokens: Tensor, steps: int = DECODE_STEPS) -> tuple[list[Tensor], list[list[int]]]:
    """transformers' greedy logits of each step and its tokens: `generate`'s, but for LongRoPE, where generate
    recomputes the whole cache with the long factors once the sequence outgrows
    original_max_position_embeddings (Phi3ForCausalLM.prepare_inputs_for_generation) and trtbuild keeps
    the cached keys and rotates each new position with its own factors (docs/models.md): there, a decode
    loop of transformers' model over its own cache, which does what trtbuild does."""
    if not longrope(hf):
        out = hf_generate(hf, tokens, steps)
        return list(out.logits), out.sequences[:, tokens.shape[1]:].tolist()
    from transformers import DynamicCache

    out = hf(input_ids=tokens, past_key_values=DynamicCache(config=hf.config), use_cache=True)
    logits, chosen = [], []
    for step in range(steps):
        logits.append(out.logits[:, -1])
        chosen.append(out.logits[:, -1].argmax(-1, keepdim=True))
        pos = tokens.shape[1] + step
        out = hf(input_ids=chosen[-1], past_key_values=out.past_key_values, use_cache=True,
                 position_ids=torch.full((tokens.shape[0], 1), pos))
    return logits, torch.cat(chosen, dim=1).tolist()


def test_longrope_generation_matches_generate_up_to_the_original_length(tmp_path: Path) -> None:
    """Below original_max_position_embeddings LongRoPE uses its short factors in both, so generate's
    tokens are trtbuild's until the sequence outgrows that length."""
    hf = hf_model("phi3-longrope-window")
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tokens = prompts()
    steps = 16 - PROMPT_LEN + 1  # the last step's logits come from position 15, the last short one
    out = hf_generate(hf, tokens, steps)
    want, _ = hf_reference(hf, tokens, steps)
    for a, b in zip(out.logits, want, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("from_start", [False, True])
@torch.no_grad()
def test_prompt_logits_match_at_every_position(pair: tuple[Any, Path], from_start: bool) -> None:
    hf, folder = pair
    tokens = prompts()
    got = ours(folder)(tokens, torch.arange(PROMPT_LEN), all_logits=True, from_start=from_start)
    want = hf(input_ids=tokens, use_cache=False).logits
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert want.abs().max() > 1.0  # the comparison is not between near-zero numbers


@pytest.mark.parametrize("windowed", [False, True])
@torch.no_grad()
def test_greedy_tokens_and_logits_match_generate(pair: tuple[Any, Path], windowed: bool) -> None:
    """Prefill, then one decode step at a time over the static cache (`windowed`: each step attends over
    exactly the filled slots, as the engine's tightest decode graph does)."""
    hf, folder = pair
    model = ours(folder)
    tokens = prompts()
    want_logits, want_tokens = hf_reference(hf, tokens)
    last = model(tokens, torch.arange(PROMPT_LEN), from_start=True)
    mine = []
    for step, want in enumerate(want_logits):
        torch.testing.assert_close(last, want, atol=ATOL, rtol=RTOL, msg=lambda m, step=step: f"decode step {step}: {m}")
        nxt = last.argmax(-1, keepdim=True)
        mine.append(nxt)
        pos = PROMPT_LEN + step
        last = model(nxt, torch.tensor([pos]), span=torch.arange(pos + 1) if windowed else None)
    assert torch.cat(mine, dim=1).tolist() == want_tokens


# -- configs: what is read, what is refused --------------------------------------------------------------


def test_the_recipe_schema_and_the_loader_know_the_same_families() -> None:
    from trtbuild.models.families import ARCHITECTURES, FAMILIES
    from trtbuild.recipe import MODEL_TYPES

    assert MODEL_TYPES == FAMILIES and set(ARCHITECTURES) == set(FAMILIES)


@pytest.mark.parametrize("name", list(CASES))
def test_parameter_count_matches_transformers(name: str) -> None:
    from trtbuild.models.llama import LlamaConfig

    hf = hf_model(name)
    cfg = LlamaConfig.from_hf(hf.config.to_dict())
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    if cfg.num_experts:  # one token reads its chosen experts only
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        unread = sum(cfg.moe_layers) * (cfg.num_experts - cfg.experts_per_token) * per_expert
        assert cfg.num_parameters(active=True) == cfg.num_parameters() - unread


def test_a_synthetic_config_left_short_means_to_trtbuild_what_it_means_to_transformers(tmp_path: Path) -> None:
    """Fields a config leaves out take transformers' defaults of the family (Gemma 3: a 256-wide head, a
    4096 window on five of every six layers, rope bases 1e6 and 1e4, tied embeddings), in both readers."""
    from trtbuild.models.checkpoint import write_synthetic

    write_synthetic(tmp_path, {"model_type": "gemma3_text", "hidden_size": 32, "intermediate_size": 48,
                               "num_hidden_layers": 7, "num_attention_heads": 2, "num_key_value_heads": 1,
                               "vocab_size": 64}, seed=0)
    _, cfg = read_config(tmp_path)
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert cfg.head_dim == hf.head_dim == 256 and cfg.tie_word_embeddings and hf.tie_word_embeddings
    assert [w == 4096 for w in cfg.layer_windows] == [t == "sliding_attention" for t in hf.layer_types]
    assert (cfg.rope_theta, cfg.local_rope_theta) == (1e6, 1e4)
    assert hf.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert cfg.attn_scale == 256 ** -0.5 and cfg.embed_scale == 32 ** 0.5
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 64, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tmp_path)(tokens, torch.arange(7), all_logits=True),
                                   model(input_ids=tokens, use_cache=False).logits, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("field,value,message", [
    ("model_type", "gpt_oss", "model_type: 'gpt_oss' is not supported"),
    ("hidden_act", "gelu", "hidden_act: 'gelu' is not supported for qwen3"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor: 0.5 is not supported"),
    ("quantization_config", {"quant_method": "awq"}, "quantization_config: pre-quantized checkpoints"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention: only causal attention"),
    ("final_logit_softcapping", 30.0, "final_logit_softcapping: not part of the qwen3 model"),
])
def test_a_field_trtbuild_does_not_implement_is_refused_by_name(tmp_path: Path, field: str, value: Any,
                                                                message: str) -> None:
    import json

    from trtbuild.errors import InputError

    hf_model("qwen3").save_pretrained(tmp_path, safe_serialization=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, field: value}))
    with pytest.raises(InputError) as info:
        read_config(tmp_path)
    assert str(info.value).startswith(f"{tmp_path / 'config.json'}: {message}")


def test_gemma3_attention_softcapping_is_refused_not_ignored(tmp_path: Path) -> None:
    """transformers' Gemma 3 never caps its attention scores, whatever the field says: a value there is
    refused, so that no one believes it applied."""
    import json

    from trtbuild.errors import InputError

    hf_model("gemma3").save_pretrained(tmp_path, safe_serialization=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "attn_logit_softcapping": 50.0}))
    with pytest.raises(InputError, match="attn_logit_softcapping: Gemma 3 does not cap"):
        read_config(tmp_path)


def test_validate_refuses_a_local_folder_with_an_unsupported_field(tmp_path: Path) -> None:
    import json

    import yaml

    from .conftest import run_cli

    hf_model("phi3").save_pretrained(tmp_path / "model", safe_serialization=True)
    raw = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**raw, "partial_rotary_factor": 0.75}))
    doc = {"name": "phi", "model": {"source": "./model"}, "backend": "torch", "precision": "fp32",
           "shapes": {"max_batch_size": 1, "max_input_len": 8, "max_seq_len": 16}}
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(doc))
    proc = run_cli("validate", str(tmp_path / "recipe.yaml"), cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "partial_rotary_factor: 0.75 is not supported" in proc.stderr


@pytest.mark.parametrize("config,problem", [
    ({"model_type": "mixtral"}, "model.config.num_local_experts: required for mixtral"),
    ({"model_type": "qwen3_moe", "num_experts": 4}, "model.config.moe_intermediate_size: required for qwen3_moe"),
    ({"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 5},
     "model.config.num_experts_per_tok: must be between 1 and num_local_experts (4)"),
    ({"model_type": "qwen3", "num_experts": 4}, "model.config.num_experts: not a field of qwen3"),
    ({"model_type": "llama", "query_pre_attn_scalar": 64}, "model.config.query_pre_attn_scalar: not a field of llama"),
    ({"model_type": "gemma3_text", "attn_logit_softcapping": 50.0},
     "model.config.attn_logit_softcapping: Gemma 3 does not cap"),
    ({"model_type": "gemma2", "hidden_act": "silu"}, "model.config.hidden_act: gemma2 takes only hidden_activation"),
    ({"model_type": "gemma3_text", "layer_types": ["full_attention"]}, "model.config.layer_types: expected one of"),
])
def test_a_synthetic_recipe_of_a_family_is_checked_field_by_field(config: dict[str, Any], problem: str) -> None:
    from tests.conftest import tiny_recipe_doc
    from trtbuild.errors import RecipeError
    from trtbuild.recipe import parse_recipe

    doc = tiny_recipe_doc()
    doc["model"]["config"].update(config)
    with pytest.raises(RecipeError) as info:
        parse_recipe(doc, Path("recipe.yaml"))
    assert any(p.startswith(problem) for p in info.value.problems), info.value.problems


def test_a_mixture_of_experts_decode_path_is_atens_on_the_cpu_and_the_kernel_only_where_asked_or_timed() -> None:
    from trtbuild.backends.torch import moe_plan
    from trtbuild.errors import TrtbuildError
    from trtbuild.models.llama import LlamaConfig
    from trtbuild.models.moe import MoE

    hf = hf_model("qwen3-moe")
    model = Transformer(LlamaConfig.from_hf(hf.config.to_dict()), 1, 16, torch.float32)
    assert moe_plan.plan(model, "auto", "cpu", 8) == {"used": "aten", "note": "aten: a CPU build"}
    assert moe_plan.plan(model, "aten", "cuda", 8)["used"] == "aten"
    assert moe_plan.plan(model, "kernel", "cuda", 8)["used"] == "kernel"
    with pytest.raises(TrtbuildError, match="options.moe_decode: 'kernel' cannot serve a CPU build"):
        moe_plan.plan(model, "kernel", "cpu", 8)
    dense = Transformer(LlamaConfig.from_hf(hf_model("qwen3").config.to_dict()), 1, 16, torch.float32)
    assert moe_plan.plan(dense, "kernel", "cpu", 8)["used"] == "aten"  # nothing to route
    moe_plan.route(model, "kernel")
    assert {m.decode_kernel for m in model.modules() if isinstance(m, MoE)} == {"kernel"}


def test_a_window_no_position_outgrows_leaves_the_layer_to_sdpas_causal_kernels() -> None:
    from trtbuild.models.families import attention_kernel_limits, windows_within
    from trtbuild.models.llama import LlamaConfig

    cfg = LlamaConfig.from_hf(hf_model("mistral-window").config.to_dict())
    assert cfg.layer_windows == (WINDOW,) * 4
    assert all(b.attention.masked for b in Transformer(cfg, 1, WINDOW + 1, torch.float32).layers)
    assert not any(b.attention.masked for b in Transformer(cfg, 1, WINDOW, torch.float32).layers)
    assert windows_within(cfg, WINDOW).layer_windows == () and attention_kernel_limits(windows_within(cfg, WINDOW)) is None
    assert "sliding windows" in str(attention_kernel_limits(windows_within(cfg, WINDOW + 1)))


def test_a_prompt_grouped_by_expert_gives_the_dense_paths_output_and_compiles() -> None:
    """options.moe_prefill grouped (bf16: torch._grouped_mm): each token's k experts only, sorted by expert;
    within bf16 rounding of the dense and gathered paths eagerly, and the same through AOTInductor on the CPU."""
    from types import SimpleNamespace

    from trtbuild.backends.torch import moe_plan
    from trtbuild.errors import TrtbuildError
    from trtbuild.models.moe import MoE

    cfg = SimpleNamespace(num_experts=6, experts_per_token=2, norm_topk_prob=False, hidden_size=64,
                          moe_intermediate_size=40)
    torch.manual_seed(0)
    m = MoE(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
    m = m.to(torch.bfloat16)
    x = torch.randn(2, 9, 64).to(torch.bfloat16)
    with torch.no_grad():
        dense = m(x, lambda t: t, None).float()
        gathered = m(x, lambda t: t, None, gathered=True).float()
        m.prefill_kernel = "grouped"
        grouped = m(x, lambda t: t, None).float()
    torch.testing.assert_close(grouped, gathered, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(grouped, dense, atol=2e-2, rtol=2e-2)

    class Prompt(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = m

        def forward(self, x: Tensor) -> Tensor:
            return self.m(x, lambda t: t, None)

    with torch.no_grad():
        ep = torch.export.export(Prompt(), (x,))
        package = torch._inductor.aoti_load_package(torch._inductor.aoti_compile_and_package(ep))
        torch.testing.assert_close(package(x).float(), grouped, atol=3e-2, rtol=3e-2)
    # only where torch._grouped_mm serves
    model = torch.nn.ModuleList([m])
    assert moe_plan.prefill_plan(model, "grouped", torch.bfloat16, "cpu")["used"] == "grouped"
    assert moe_plan.prefill_plan(model, "dense", torch.bfloat16, "cpu")["used"] == "dense"
    with pytest.raises(TrtbuildError, match="options.moe_prefill: 'grouped' cannot serve this build: .*bf16 only"):
        moe_plan.prefill_plan(model, "grouped", torch.float32, "cpu")


def test_a_rope_base_left_out_takes_the_familys_default_and_one_in_rope_parameters_is_kept() -> None:
    from trtbuild.models.llama import LlamaConfig

    base = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
            "num_attention_heads": 4, "vocab_size": 64}
    assert LlamaConfig.from_hf(base).rope_theta == 1e6  # transformers' Mixtral default
    assert LlamaConfig.from_hf({**base, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}).rope_theta == 1e6
    assert LlamaConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}).rope_theta == 5e5
