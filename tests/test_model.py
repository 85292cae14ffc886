"""Our Transformer against Hugging Face transformers' own implementation of the same config and weights.

The weights travel the way users' weights do: transformers writes a safetensors checkpoint, and our
loader (`read_config` + `load_weights` + `convert_hf_state_dict`) reads it back. fp32 on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch import Tensor

from tests.conftest import TINY_CONFIG, make_hf_folder
from trtbuild.models.checkpoint import convert_hf_state_dict, load_weights, read_config
from trtbuild.models.llama import Transformer

ATOL = RTOL = 1e-4
BATCH, PROMPT_LEN, DECODE_STEPS = 2, 9, 12
MAX_SEQ_LEN = PROMPT_LEN + DECODE_STEPS + 3  # slack: the static cache is longer than what is used

BASE: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=128, rms_norm_eps=1e-5, max_position_embeddings=64,
                            tie_word_embeddings=False)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # with head_dim 16 and theta 5e5 the wavelengths span the unscaled, smoothed and scaled bands
               "original_max_position_embeddings": 64}

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("llama", {}),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-rope-theta": ("llama", {"rope_theta": 500000.0}),
    "llama3-rope-scaling": ("llama", {"hidden_size": 64, "rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}),
    "llama-attention-and-mlp-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-head-dim": ("llama", {"head_dim": 16}),
    "qwen2": ("qwen2", {"rope_theta": 1000000.0, "num_key_value_heads": 1}),
    "mistral": ("mistral", {"hidden_size": 64, "num_attention_heads": 8}),
}


def hf_model(model_type: str, overrides: dict[str, Any]) -> Any:
    config_cls, model_cls = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
                             "mistral": ("MistralConfig", "MistralForCausalLM"),
                             "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}[model_type]
    config = getattr(transformers, config_cls)(**{**BASE, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    _randomize(model)
    return model


@torch.no_grad()
def _randomize(model: torch.nn.Module) -> None:
    """Every parameter random and O(1) logits: HF's init (std 0.02, zero biases, unit norms) would leave
    biases and norm weights untested and the logits too small for a tolerance to mean much."""
    gen = torch.Generator().manual_seed(1)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen))
        else:
            p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def ours_from_folder(folder: Path, max_seq_len: int = MAX_SEQ_LEN) -> Transformer:
    """The loading path a user's checkpoint takes."""
    _, cfg = read_config(folder)
    model = Transformer(cfg, max_batch_size=BATCH, max_seq_len=max_seq_len, dtype=torch.float32)
    model.load_state_dict(convert_hf_state_dict(load_weights(folder, cfg, torch.float32), cfg), strict=True)
    return model.eval()


def prompts(vocab: int = 128) -> Tensor:
    return torch.randint(0, vocab, (BATCH, PROMPT_LEN), generator=torch.Generator().manual_seed(2))


@pytest.fixture(params=list(CONFIGS), scope="module")
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    model_type, overrides = CONFIGS[request.param]
    hf = hf_model(model_type, overrides)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder, safe_serialization=True)
    return hf, folder


@torch.no_grad()
def hf_logits(hf: Any, tokens: Tensor) -> Tensor:
    return hf(input_ids=tokens, use_cache=False).logits


@pytest.mark.parametrize("from_start", [False, True])
@torch.no_grad()
def test_prefill_logits_match_at_every_position(pair: tuple[Any, Path], from_start: bool) -> None:
    hf, folder = pair
    ours = ours_from_folder(folder)
    tokens = prompts()
    got = ours(tokens, torch.arange(PROMPT_LEN), all_logits=True, from_start=from_start)
    want = hf_logits(hf, tokens)
    assert got.shape == want.shape == (BATCH, PROMPT_LEN, 128)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert want.abs().max() > 1.0  # the comparison is not between near-zero numbers


@pytest.mark.parametrize("from_start,windowed", [(False, False), (True, False), (True, True)])
@torch.no_grad()
def test_greedy_decode_matches_full_recompute(pair: tuple[Any, Path], from_start: bool, windowed: bool) -> None:
    """`windowed`: each decode step attends over exactly the filled slots (the tightest span the
    engine's decode graphs can be run at), not the whole static cache."""
    hf, folder = pair
    ours = ours_from_folder(folder)
    seq = prompts()
    last = ours(seq, torch.arange(PROMPT_LEN), from_start=from_start)
    for step in range(DECODE_STEPS):
        want = hf_logits(hf, seq)[:, -1]
        torch.testing.assert_close(last, want, atol=ATOL, rtol=RTOL, msg=lambda m, step=step: f"decode step {step}: {m}")
        # HF's choice drives both, so one near-tie cannot send the two down different paths
        nxt = want.argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
        pos = seq.shape[1] - 1
        last = ours(nxt, torch.tensor([pos]), span=torch.arange(pos + 1) if windowed else None)


@pytest.mark.parametrize("pad", [0, 7])
@torch.no_grad()
def test_decode_matches_hf_kv_cache_generation(pair: tuple[Any, Path], pad: int) -> None:
    """`pad`: the prompt handed over the way a captured prefill graph pads it (prefill_graphs.py): rows of
    any token after it at position max_seq_len - 1. Its first token and the decode after it stay HF's: the
    model takes the prompt's last row (llama.prompt_end), and the padding's cache writes land where no step reads."""
    hf, folder = pair
    ours = ours_from_folder(folder)
    tokens = prompts()
    padding = torch.randint(0, 128, (BATCH, pad), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(PROMPT_LEN), torch.full((pad,), MAX_SEQ_LEN - 1)])
    out = hf.generate(input_ids=tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=DECODE_STEPS,
                      min_new_tokens=DECODE_STEPS, do_sample=False, output_logits=True, return_dict_in_generate=True,
                      pad_token_id=0)
    seq = out.sequences
    last = ours(torch.cat([tokens, padding], dim=1), positions, from_start=True)
    for step, want in enumerate(out.logits):
        torch.testing.assert_close(last, want, atol=ATOL, rtol=RTOL, msg=lambda m, step=step: f"decode step {step}: {m}")
        pos = PROMPT_LEN + step
        last = ours(seq[:, pos:pos + 1], torch.tensor([pos]))


@torch.no_grad()
def test_sharded_checkpoint_loads_identically(tmp_path: Path) -> None:
    hf = hf_model("llama", {})
    hf.save_pretrained(tmp_path / "single", safe_serialization=True)
    hf.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert not (tmp_path / "sharded" / "model.safetensors").exists()
    single, sharded = ours_from_folder(tmp_path / "single"), ours_from_folder(tmp_path / "sharded")
    for name, tensor in single.state_dict().items():
        assert torch.equal(tensor, sharded.state_dict()[name]), name
    tokens = prompts()
    torch.testing.assert_close(sharded(tokens, torch.arange(PROMPT_LEN), all_logits=True), hf_logits(hf, tokens),
                               atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_synthetic_folder_means_the_same_model_to_hugging_face(tmp_path: Path) -> None:
    # The other direction: what write_synthetic writes (old-style top-level rope_theta) is read by
    # transformers as the model we build from it.
    folder = make_hf_folder(tmp_path / "m", {**TINY_CONFIG, "rope_theta": 500000.0, "attention_bias": True}, seed=5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = prompts()
    torch.testing.assert_close(ours_from_folder(folder)(tokens, torch.arange(PROMPT_LEN), all_logits=True),
                               hf_logits(hf, tokens), atol=ATOL, rtol=RTOL)


def test_config_reads_rope_theta_from_rope_parameters(tmp_path: Path) -> None:
    # transformers 5 writes rope_theta only inside rope_parameters
    hf = hf_model("llama", {"rope_theta": 500000.0})
    hf.save_pretrained(tmp_path, safe_serialization=True)
    raw, cfg = read_config(tmp_path)
    assert "rope_theta" not in raw and raw["rope_parameters"]["rope_theta"] == 500000.0
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling is None


def test_parameter_count_matches_hugging_face() -> None:
    from trtbuild.models.llama import LlamaConfig

    for name in ("llama-gqa", "llama-tied", "llama-head-dim"):
        model_type, overrides = CONFIGS[name]
        hf = hf_model(model_type, overrides)
        cfg = LlamaConfig.from_hf(hf.config.to_dict())
        assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters()), name


def test_decode_windows_cover_every_position_and_halve_down_to_16() -> None:
    from trtbuild.backends.torch.decode_graphs import decode_windows

    assert decode_windows(4096) == [128, 256, 512, 1024, 2048, 4096]
    assert decode_windows(48) == [24, 48]
    assert decode_windows(20) == [20]
    assert decode_windows(8) == [8]


def test_a_generation_prepares_only_the_windows_its_positions_decode_in() -> None:
    from trtbuild.backends.torch.decode_graphs import windows_between

    windows = [128, 256, 512, 1024, 2048, 4096]
    assert windows_between(windows, 128, 255) == [256]  # the benchmark's 128-token prompt, 128 new tokens
    assert windows_between(windows, 100, 300) == [128, 256, 512]
    assert windows_between(windows, 127, 129) == [128, 256]
    assert windows_between(windows, 4000, 4095) == [4096]
    assert windows_between(windows, 10, 10) == []  # one new token: no decode step, nothing to capture



@pytest.mark.parametrize("vocab", [100, 4096, 128256])
def test_greedy_token_is_argmax_ties_included(vocab: int) -> None:
    """The chunked argmax of the compiled graphs picks argmax's index: vocabularies smaller than a
    chunk, a multiple of it and neither; the maximum repeated in one chunk and across chunks."""
    from trtbuild.models.llama import greedy_token

    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g).to(torch.bfloat16)  # bf16: ties happen
    logits[1, [vocab // 3, vocab // 2, vocab - 1]] = 50.0  # the first of three, in different chunks
    logits[2, [vocab - 2, vocab - 1]] = 50.0  # two in the last (padded) chunk
    logits[3] = 1.0  # all equal: index 0
    assert torch.equal(greedy_token(logits), logits.argmax(-1, keepdim=True))
    assert greedy_token(logits)[1].item() == vocab // 3


def test_decode_fusion_is_never_for_a_linear_with_a_bias() -> None:
    """What each Linear asks of the decode matmul kernel, and the plan's keys as recorded for the
    compile workers (which parse them back)."""
    from trtbuild.backends.torch.decode_kernels import fusion_of, key_name, parse_key
    from trtbuild.models.llama import Linear

    up, up_bias = Linear(32, 64, bias=False, fusion="norm_gate"), Linear(32, 64, bias=True, fusion="norm_gate")
    assert [fusion_of(up, "none"), fusion_of(up, "epilogue"), fusion_of(up_bias, "epilogue")] == ["none", "gate", "none"]
    # the norm before a matmul stays outside the kernel: QKV's call site is a plain matmul
    assert fusion_of(Linear(32, 64, bias=False, fusion="norm"), "epilogue") == "none"
    for key in [(64, 32, "none"), (96, 32, "norm_gate"), (32, 48, "residual")]:
        assert parse_key(key_name(key)) == key
    assert key_name((64, 32, "none")) == "64x32" and key_name((96, 32, "norm_gate")) == "96x32+norm_gate"


def test_a_fused_call_site_takes_the_fastest_of_cublas_the_fused_kernel_and_the_kernel_alone() -> None:
    """The plan's choice per call site, from the selection's timings (µs; numbers the H200 measured on 2026-12-04),
    with the time of one call the way chosen (what the run report adds up)."""
    from trtbuild.backends.torch.decode_kernels import pick as pick_timed

    def pick(*args: Any) -> tuple[str | None, str, float | None]:
        chosen, does, us = pick_timed(*args)
        return chosen, does, None if us is None else round(us, 2)

    def timings(fusion: str, choice: str, cublas: float, unfused: float | None, **candidates: float | str) -> dict:
        return {"fusion": fusion, "choice": choice, "cublas_us": cublas, "candidates": candidates,
                **({} if unfused is None else {"unfused_us": unfused})}

    # 8B QKV at batch 8: the fused norm lost to cuBLAS + Inductor's norm, the kernel alone + that norm wins
    qkv = timings("norm", "cublas", 15.76, 17.68, fused=31.64, broken="failed: OutOfResources")
    # (the kernel alone + Inductor's norm: 14.79 + 17.68 - 15.76)
    assert pick(qkv, timings("none", "plain", 15.53, None, plain=14.79), "auto") == ("plain", "none", 16.71)
    assert pick(qkv, None, "auto") == ("cublas", "none", 17.68)  # with Inductor's norm
    assert pick(qkv, None, "kernel") == ("fused", "norm", 31.64)  # kernel mode: the fused kernel, fastest configuration
    # 1B output projection at batch 1: the fused residual add beats the kernel alone + Inductor's add
    out = timings("residual", "fused", 6.24, 7.45, fused=5.76)
    assert pick(out, timings("none", "plain", 6.23, None, plain=5.51), "auto") == ("fused", "residual", 5.76)
    # no Inductor timing of the unfused code (its compile failed): the selection's own choice stands
    failed = timings("residual", "fused", 6.24, None, fused=5.76) | {"unfused_us": "failed: BackendCompilerFailed"}
    assert pick(failed, timings("none", "plain", 6.23, None, plain=1.0), "auto") == ("fused", "residual", 5.76)
    # a call site without fusion: cuBLAS or the kernel, as timed
    assert pick(timings("none", "cublas", 18.06, None, plain=18.38), None, "auto") == ("cublas", "none", 18.06)
    assert pick(timings("none", "cublas", 1.0, None, broken="failed: x"), None, "kernel") == (None, "none", None)
    # 8B gate/up at batch 1 under epilogue (2026-12-05): cuBLAS + the gating timed faster than cuBLAS alone
    # (58.51 against 62.02), noise; the plain kernel + a negative gating (59.34 - 3.51) must not beat the
    # fused kernel (57.70), which would add Inductor's gating kernel to every layer
    gated = timings("gate", "fused", 62.02, 58.51, fused=57.70)
    assert pick(gated, timings("none", "plain", 62.01, None, plain=59.34), "auto") == ("fused", "gate", 57.70)


def test_the_h200s_8b_timings_route_every_fused_call_site_to_the_fused_kernel() -> None:
    """The plan's choices from the 8B selection the H200 measured on 2026-12-05 (tests/golden), paired the way
    matmul_plan pairs them (each fused call site with the plain timing of its shape). That build put the
    plain kernel + Inductor's gating at gate/up for batch 1, because cuBLAS + the gating timed faster than
    cuBLAS alone there; the step took one kernel more a layer and 0.18 ms more. With Inductor's share never
    below nothing, every fused site is the fused kernel's, at both batches."""
    import json

    from trtbuild.backends.torch.decode_kernels import parse_key, pick

    golden = json.loads((Path(__file__).parent / "golden" / "selection_h200_8b.json").read_text())
    gate = golden["decode_b1"]["28672x4096+gate"]
    assert gate["unfused_us"] < gate["cublas_us"]  # the noise that misled the plan
    for graph in ("decode_b1", "decode_b8"):
        sites = golden[graph]
        chosen = {}
        for name, result in sites.items():
            n, k, fusion = parse_key(name)
            if fusion != "none":
                chosen[name] = pick(result, sites[f"{n}x{k}"], "auto")[:2]
        assert chosen == {name: (sites[name]["choice"], parse_key(name)[2]) for name in chosen}, graph
        assert len(chosen) == 3


def test_a_k_step_of_4096_is_a_candidate_only_where_the_rows_are_that_wide() -> None:
    from trtbuild.kernels.matmul_configs import ONE_ROW, ONE_ROW_WIDE_K, ROWS, candidates, one_stage

    assert ONE_ROW_WIDE_K and all(c.block_k == 4096 and c not in ONE_ROW for c in ONE_ROW_WIDE_K)
    # rows 2048 wide (1B's, but for its down projection): the list, and so its cached timings' key, is unchanged
    assert candidates(1, "gate", k=2048) == one_stage(ONE_ROW) == candidates(1)
    assert candidates(1, "gate", k=4096) == one_stage(ONE_ROW + ONE_ROW_WIDE_K) == candidates(1, "residual", k=14336)
    assert candidates(8, k=4096) == ROWS  # the tensor-core path keeps its list


def test_tactics_default_times_the_likely_configurations_and_max_every_one() -> None:
    """`full=False` (tactics default) keeps, of each list, the configurations in LIKELY: every winner the H100
    gate's timings recorded at the 1B call sites, and the 8B's wide steps; under half of each list. The
    split-K lists are kept whole."""
    from trtbuild.kernels.matmul_configs import (LIKELY, ONE_ROW, ONE_ROW_SPLIT, ONE_ROW_WIDE_K, ROWS,
                                                 candidates, one_stage)

    one, rows = candidates(1, "gate", k=4096, full=False), candidates(8, k=4096, full=False)
    assert all(c in ONE_ROW + ONE_ROW_WIDE_K for c in one) and all(c in ROWS for c in rows)
    assert len(one) < len(ONE_ROW + ONE_ROW_WIDE_K) / 2 and len(rows) < len(ROWS) / 2
    # one row: n2k2048 and n4k2048 won with stages 1 and 3, which compile to the same kernel there
    winners = {"n2k2048w4s1", "n4k2048w4s1", "n16k512w4s4", "n32k128w4s3", "n64k128w4s3"}
    assert winners <= {c.name for c in one + rows} and {c.name for c in one + rows} <= LIKELY
    assert candidates(1, "none", True, k=8192, n=2048, full=False)[-len(ONE_ROW_SPLIT):] == ONE_ROW_SPLIT
    assert candidates(1, "gate", k=4096) == one_stage(ONE_ROW + ONE_ROW_WIDE_K)  # max: the whole list


def test_blocks_larger_than_a_small_matrix_are_timed_once() -> None:
    """A 64 x 128 weight: every k step past 128 and every block of rows past 64 covers the same work as a
    smaller one, so only the first of each such group is timed; the 1B and 8B shapes keep every candidate
    (so their cached timings stay valid)."""
    from trtbuild.kernels.matmul_configs import ONE_ROW, ONE_ROW_SPLIT, ONE_ROW_WIDE_K, ROWS, candidates, one_stage

    small = candidates(1, "none", k=128, n=64)
    assert len(small) < len(ONE_ROW) / 2 and all(c in ONE_ROW for c in small)
    assert {(min(c.block_k, 128), c.block_n, c.warps, c.stages) for c in small} == \
        {(min(c.block_k, 128), c.block_n, c.warps, c.stages) for c in one_stage(ONE_ROW)}
    assert len(candidates(8, k=64, n=64)) < len(ROWS)
    assert candidates(1, "gate", k=2048, n=16384) == one_stage(ONE_ROW)
    assert candidates(1, "none", True, k=8192, n=2048) == one_stage(ONE_ROW + ONE_ROW_WIDE_K + ONE_ROW_SPLIT)
    assert candidates(8, k=4096, n=4096) == ROWS


def test_an_epilogue_plan_routes_each_call_site_the_way_its_timings_say(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """matmul_plan end to end with a stand-in for the Triton module (the real one needs a GPU): the call
    sites are grouped by shape and fusion, each timed once and kept in the tactic cache, and the plan
    holds the fused kernel, the kernel alone or nothing, as `pick` decides. A rebuild times nothing."""
    import sys
    import types
    from dataclasses import dataclass as dc

    from trtbuild.backends.torch import decode_kernels
    from trtbuild.backends.torch.decode_kernels import matmul_plan
    from trtbuild.models.llama import LlamaConfig

    @dc(frozen=True)
    class Config:
        name: str

        @classmethod
        def parse(cls, name: str) -> "Config":
            return cls(name)

    timed: list[tuple[int, int, str]] = []

    def select(weights: list[Tensor], rows: int, fusion: str, split: bool = False,
               configs: list[Config] | None = None) -> dict[str, Any]:
        assert configs == candidates(rows, fusion, split, weights[0].shape[1], weights[0].shape[0], False)
        widths.pop()
        n, k = weights[0].shape
        timed.append((n, k, fusion) + (("split",) if split else ()))
        fused = fusion != "none"
        # gate/up (gate): the fused kernel is slow, the plain one fast; everything else: the fused kernel wins
        slow = fusion == "gate"
        return {"fusion": fusion, "cublas_us": 10.0, "choice": "cublas" if slow else "k", "candidates":
                {"k": 20.0 if slow else (8.0 if fused else 9.5)}, **({"unfused_us": 12.0} if fused else {}),
                "seconds": {"references_s": 0.5, "candidates_s": 0.25}}

    widths: list[int] = []  # the row width each candidate list was asked for (lists may differ by width)
    fulls: set[bool] = set()  # whether each list asked for was the full one

    def candidates(rows: int, fusion: str = "none", split: bool = False, k: int = 0, n: int = 0,
                   full: bool = True) -> list[Config]:
        widths.append(k)
        fulls.add(full)
        return [Config("k")] + [Config("k-split")] * split

    fake = types.SimpleNamespace(MAX_ROWS=16, MatmulConfig=Config, select=select, source_digest=lambda: "src",
                                 candidates=candidates)
    from trtbuild.backends.torch import kernel_warmup

    ahead: list[list[tuple[Any, ...]]] = []  # what each plan handed to be compiled ahead of its timings
    monkeypatch.setattr(kernel_warmup, "precompile", lambda work, device, progress: ahead.append(work) or {})
    monkeypatch.setitem(sys.modules, "trtbuild.kernels.decode_matmul", fake)
    import trtbuild.kernels

    # `from trtbuild.kernels import decode_matmul` reads the package's attribute first, which an earlier import
    # of the real module (another test in the same process) has set
    monkeypatch.setattr(trtbuild.kernels, "decode_matmul", fake, raising=False)
    cfg = LlamaConfig.from_hf(dict(TINY_CONFIG))
    model = Transformer(cfg, max_batch_size=2, max_seq_len=16, dtype=torch.float32)
    job = types.SimpleNamespace(tactics=types.SimpleNamespace(path=tmp_path), progress=lambda message: None)
    split_s: dict[str, float] = {}
    plan, record = matmul_plan(model, (1,), "default", "auto", "cuda", job, "epilogue",  # type: ignore[arg-type]
                               seconds=split_s)
    d, f = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    shapes = [(qkv, d), (d, d), (2 * f, d), (d, f), (cfg.vocab_size, d)]
    assert (2 * f, d) == (cfg.vocab_size, d)  # gate/up's plain matmul and the LM head: one key of the plan
    # gate/up: 20 fused vs 12 cuBLAS + its gating vs 9.5 + (12 - 10) = 11.5 for the kernel alone with Inductor's
    # gating; the norms stay outside the kernel, so QKV and the LM head are plain matmuls
    assert {key: c.name for key, c in plan[1].items()} == {
        (qkv, d, "none"): "k", (d, d, "residual"): "k", (2 * f, d, "none"): "k", (d, f, "residual"): "k"}
    assert record["decode_b1"][f"{2 * f}x{d}+gate"]["fused"] is False
    assert record["decode_b1"][f"{2 * f}x{d}+gate"]["kernel_does"] == "none"
    # what a step's matmuls take as timed, for the run report: gate/up the kernel alone + Inductor's gating
    # (11.5), the fused kernel (8.0) at the residual adds, the plain kernel (9.5) at QKV and, once, the LM head
    layers = cfg.num_layers
    assert [(r["calls"], r["chosen_us"]) for r in record["decode_b1"].values()] == \
        [(layers, 9.5), (layers, 8.0), (layers, 11.5), (layers, 8.0), (1, 9.5)]
    assert decode_kernels.timed_step_us(record, 1) == layers * 37.0 + 9.5
    assert decode_kernels.timed_step_us(record, 8) is None
    # gate/up's gating is Inductor's (the kernel alone won), every other fusion is the kernel's
    assert decode_kernels.fused_outside(record, 1) == [f"{2 * f}x{d}+gate"]
    assert decode_kernels.fused_outside(record, 8) == []
    # each fused call site timed once with its fusion and once without, for `pick`; the LM head and
    # gate/up share a shape but not a layer count, so each has its own plain timing
    fusions = ["none", "residual", "gate", "residual", "none"]
    assert sorted(timed) == sorted([(n, k, fusion) for (n, k), fusion in zip(shapes, fusions, strict=True)]
                                   + [(n, k, "none") for (n, k), fusion in zip(shapes, fusions) if fusion != "none"])
    assert sorted(set(widths)) == sorted({k for _, k in shapes})  # each call site's own row width
    assert fulls == {False}  # tactics `default`: the likely configurations only (matmul_configs.LIKELY)
    # the build's phases: every fresh selection's seconds by part (the stand-in says 0.5 s and 0.25 s each)
    assert split_s["timing_references_s"] == 0.5 * len(timed) and split_s["timing_candidates_s"] == 0.25 * len(timed)
    # compiled ahead, in parallel (kernel_warmup.py): exactly the timings then taken, each with its candidates
    assert len(ahead) == 1 and sorted((n, k, fusion) for _, n, k, fusion, _, _ in ahead[0]) == sorted(timed)
    assert all(rows == 1 and configs == ("k",) and dtype == "torch.float32" for rows, _, _, _, dtype, configs in ahead[0])
    timed.clear()
    again, _ = matmul_plan(model, (1,), "default", "auto", "cuda", job, "epilogue")  # type: ignore[arg-type]
    assert again == plan and timed == [] and len(ahead) == 1  # every timing from the tactic cache: nothing to compile
    # options.decode_split_k timed: another candidate list, so new timings (the cached ones stay valid)
    matmul_plan(model, (1,), "default", "auto", "cuda", job, "none", "timed")  # type: ignore[arg-type]
    assert sorted(timed) == sorted({(n, k, "none", "split") for n, k in shapes})
    # options.decode_fusion none: plain matmuls only, timed already by the epilogue plan but for gate/up's
    # shape, which now holds gate/up's and the LM head's matrices in one group (a timing of its own)
    timed.clear()
    plan, _ = matmul_plan(model, (1,), "default", "auto", "cuda", job, "none")  # type: ignore[arg-type]
    assert timed == [(2 * f, d, "none")]
    assert sorted(plan[1]) == sorted({(n, k, "none") for n, k in shapes})


def test_the_kernels_inline_assembly_has_no_escaped_line_breaks() -> None:
    """AOTInductor writes each user kernel's source into a file of its own for its autotuning subprocess,
    and an assembly string's `\\n` became a real line break there: the file no longer parsed (the
    L2-prefetch kernel of 2026-12-04 failed so on the H200, before any token). Instructions in
    one inline_asm_elementwise string are joined with `;` instead."""
    import ast

    kernels = Path(__file__).resolve().parents[1] / "trtbuild" / "kernels"
    calls = [node for f in sorted(kernels.glob("*.py")) for node in ast.walk(ast.parse(f.read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "inline_asm_elementwise"]
    assert calls  # the wait and the release (grid_dependency.py)
    assembly = [c.args[0].value for c in calls if isinstance(c.args[0], ast.Constant)]
    assert len(assembly) == len(calls) and not any("\n" in a or "\t" in a for a in assembly)
