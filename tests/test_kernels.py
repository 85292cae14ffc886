"""trtbuild's Triton kernels on the CPU, through Triton's interpreter (TRITON_INTERPRET=1), against the
model's own ATen code. Skipped where Triton is not installed (CI's CPU torch does not bring it; the H200
runs the compiled kernels in tests/test_gpu.py). fp32 throughout: the
interpreter's bf16 dot is not reliable."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

if not torch.cuda.is_available():  # read when the kernels are defined, so before they are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[1]


def benchmark_module(name: str) -> ModuleType:
    """One of benchmarks/probes/'s scripts, imported as a module (they are scripts, not a package)."""
    if str(ROOT / "benchmarks" / "probes") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks" / "probes"))
    return importlib.import_module(name)


@pytest.mark.parametrize(("batch", "heads", "kv_heads", "head_dim", "pos"),
                         [(1, 8, 2, 16, 0), (2, 8, 2, 16, 40), (1, 4, 4, 32, 127), (3, 6, 2, 16, 250)])
def test_decode_attention_matches_the_masked_attention_of_the_model(
        batch: int, heads: int, kv_heads: int, head_dim: int, pos: int) -> None:
    """Every position from the first slot to past several slices, with and without grouped queries,
    and fewer sequences than the cache holds (the kernel must read only the first `batch`)."""
    from trtbuild.kernels.decode_attention import decode_attention
    from trtbuild.models.llama import _cached_attention

    g = torch.Generator().manual_seed(pos)
    q = torch.randn(batch, 1, heads, head_dim, generator=g).to(DEVICE)
    k_cache, v_cache = (torch.randn(batch + 1, kv_heads, 300, head_dim, generator=g).to(DEVICE) for _ in range(2))
    p = torch.tensor([pos], device=DEVICE)
    got = decode_attention(q, k_cache, v_cache, p)
    want = _cached_attention(q.transpose(1, 2), k_cache[:batch], v_cache[:batch], p,
                             torch.arange(pos + 1, device=DEVICE)).transpose(1, 2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("batch", "heads", "kv_heads", "pos"), [(1, 8, 2, 0), (2, 8, 2, 40), (3, 6, 2, 250)])
def test_decode_attention_with_rope_rotates_writes_the_cache_and_attends_as_the_model_does(
        batch: int, heads: int, kv_heads: int, pos: int) -> None:
    """From the QKV projection's output: the query and new key rotated by the table's row for pos, the new
    key and value stored at slot pos of the first `batch` sequences (every other slot untouched), and the
    attention over slots 0..pos the model's ATen code computes after its own rope and cache writes."""
    from trtbuild.kernels.decode_attention import decode_attention_rope
    from trtbuild.models.llama import LlamaConfig, _cached_attention, apply_rope, rope_table

    d, slots = 16, 300
    cfg = LlamaConfig(vocab_size=8, hidden_size=heads * d, intermediate_size=8, num_layers=1, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=d, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                      tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False)
    rope = rope_table(cfg, slots).to(DEVICE)
    g = torch.Generator().manual_seed(pos)
    qkv = torch.randn(batch, 1, (heads + 2 * kv_heads) * d, generator=g).to(DEVICE)
    k_cache, v_cache = (torch.randn(batch + 1, kv_heads, slots, d, generator=g).to(DEVICE) for _ in range(2))
    p = torch.tensor([pos], device=DEVICE)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    table = rope[p]
    q = apply_rope(q.view(batch, 1, heads, d), table)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    k_want[:batch, :, pos] = apply_rope(k.view(batch, 1, kv_heads, d), table)[:, 0]
    v_want[:batch, :, pos] = v.view(batch, kv_heads, d)
    want = _cached_attention(q.transpose(1, 2), k_want[:batch], v_want[:batch], p,
                             torch.arange(pos + 1, device=DEVICE)).transpose(1, 2)
    got = decode_attention_rope(qkv, rope, k_cache, v_cache, p, heads)
    torch.testing.assert_close(k_cache, k_want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v_cache, v_want, atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_steps_through_the_attention_kernel_give_the_logits_of_the_aten_model() -> None:
    """A prompt through the model's ATen path, then decode steps with every Attention routed to the kernel
    (as a decode graph routes them): the same logits as the unrouted model, step after step, so the cache
    the kernel writes is the one the next step reads."""
    from trtbuild.backends.torch.decode_kernels import routed
    from trtbuild.models.llama import LlamaConfig, Transformer

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=True,
                      qkv_bias=False, o_bias=False, mlp_bias=False)
    torch.manual_seed(0)
    models = [Transformer(cfg, max_batch_size=2, max_seq_len=16, dtype=torch.float32).to(DEVICE) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    prompt = torch.randint(0, 64, (2, 5), device=DEVICE)
    logits = [m(prompt, torch.arange(5, device=DEVICE), from_start=True) for m in models]
    for step in range(5, 9):
        tokens = logits[0].argmax(-1, keepdim=True)
        pos = torch.tensor([step], device=DEVICE)
        want = models[0](tokens, pos)
        with routed(models[1], {}, "kernel"):
            got = models[1](tokens, pos)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        logits = [want, got]
    assert models[1].layers[0].attention.decode_kernel == "aten"  # routing ends with the export


@pytest.mark.parametrize("fusion", ["none", "norm", "residual", "norm_gate", "gate", "rms", "rms_gate"])
@pytest.mark.parametrize(("rows", "k"), [(1, 96), (3, 96), (2, 80), (1, 24)])
def test_decode_matmul_with_each_fusion_matches_the_aten_ops_it_replaces(fusion: str, rows: int, k: int) -> None:
    """One row (multiply-and-sum) and several (dot), k a multiple of the block and not (masked loads; k 24:
    one block, and masked), against `reference`: the norm, gating and residual add in the model's own ATen
    order. rms and rms_gate normalize without reading a gain (folded into w): their reference is the norm
    with a gain of ones, which an rms sum left out (or a gain read from w's stand-in pointer) would miss."""
    from trtbuild.kernels.decode_matmul import GATED, MatmulConfig, decode_matmul, reference

    g = torch.Generator().manual_seed(rows * k)
    n = 40  # not a multiple of block_n: the last program's columns are masked
    w = torch.randn(2 * n if fusion in GATED else n, k, generator=g).to(DEVICE)
    x = (3 * torch.randn(rows, k, generator=g)).to(DEVICE)  # a residual stream's scale, far from unit rms
    gain = (torch.rand(k, generator=g) + 0.5).to(DEVICE) if "norm" in fusion else None
    ones = torch.ones(k).to(DEVICE) if "rms" in fusion else None
    residual = torch.randn(rows, n, generator=g).to(DEVICE) if fusion == "residual" else None
    got = decode_matmul(x, w, MatmulConfig(16, 32, 4, 1), norm=gain, eps=1e-5, gate=fusion in GATED,
                        residual=residual, rms="rms" in fusion)
    want = reference(x, w, fusion, gain if ones is None else ones, 1e-5, residual)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize(("rows", "k"), [(1, 96), (3, 96), (2, 80), (1, 24)])
def test_split_k_adds_its_partial_sums_to_the_plain_matmul(rows: int, k: int, split: int) -> None:
    """Split-K: `split` programs per block of columns, each a slice of k, then the reduce kernel. k 96 in
    slices of 32 over 4 programs leaves the last slice empty (it must write zeros, not leave garbage in
    the workspace); k 80 ends in a masked block; k 24 is one short block for the first program alone."""
    from trtbuild.kernels.decode_matmul import MatmulConfig, decode_matmul, reference

    g = torch.Generator().manual_seed(rows * k + split)
    w = torch.randn(40, k, generator=g).to(DEVICE)
    x = torch.randn(rows, k, generator=g).to(DEVICE)
    config = MatmulConfig(16, 32, 4, 1, split)
    assert config.name == f"n16k32w4s1p{split}" and MatmulConfig.parse(config.name) == config
    out = torch.full((rows, 40), float("nan"), device=DEVICE)
    torch.testing.assert_close(decode_matmul(x, w, config, out=out), reference(x, w, "none"), atol=1e-4, rtol=1e-4)


def test_split_k_is_a_candidate_for_the_plain_matmul_only() -> None:
    from trtbuild.kernels.decode_matmul import decode_matmul
    from trtbuild.kernels.matmul_configs import MatmulConfig, candidates

    for rows in (1, 8):  # only with options.decode_split_k timed, and only for the plain matmul
        assert any(c.split > 1 for c in candidates(rows, "none", True))
        assert [c for c in candidates(rows, "none", True) if c.split == 1] == candidates(rows) == candidates(rows, "norm", True)
    assert MatmulConfig.parse("n8k1024w4s3") == MatmulConfig(8, 1024, 4, 3, 1)  # names from before split-K
    x, w = torch.randn(1, 64).to(DEVICE), torch.randn(32, 64).to(DEVICE)
    with pytest.raises(ValueError, match="plain matmul only"):
        decode_matmul(x, w, MatmulConfig(16, 32, 4, 1, 2), residual=torch.zeros(1, 32).to(DEVICE))


def test_a_routed_model_computes_what_the_unrouted_one_does_with_and_without_fusion() -> None:
    """Every Linear of a small model through the kernel (as a decode graph routes them), with its call site's
    epilogue fused and matmul-only: the same logits as the model's ATen path."""
    from trtbuild.backends.torch.decode_kernels import fusion_of, routed
    from trtbuild.kernels.decode_matmul import MatmulConfig
    from trtbuild.models.llama import Linear, LlamaConfig, Transformer

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=True,
                      qkv_bias=False, o_bias=False, mlp_bias=False)
    torch.manual_seed(0)
    model = Transformer(cfg, max_batch_size=2, max_seq_len=16, dtype=torch.float32).to(DEVICE)
    for mod in model.modules():  # norms away from 1, so a missing norm weight would show
        if hasattr(mod, "eps"):
            torch.nn.init.uniform_(mod.weight, 0.5, 1.5)
    tokens = torch.randint(0, 64, (2, 1), device=DEVICE)
    pos = torch.tensor([0], device=DEVICE)
    want = model(tokens, pos)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    whole, split = MatmulConfig(16, 32, 4, 1), MatmulConfig(16, 32, 4, 1, 2)  # split-K: the plain matmul only
    assert {m.fusion for m in linears} == {"norm", "residual", "norm_gate"}
    for mode, config in (("epilogue", whole), ("none", whole), ("none", split)):
        plan = {(m.out_features, m.in_features, fusion_of(m, mode)): config for m in linears}
        with routed(model, plan):
            assert all(m.decode_config is config for m in linears)
            # the gating and residual adds in the kernel under epilogue, every norm outside it
            assert {m.fusion: m.decode_fusion for m in linears} == (
                {"norm": "none", "residual": "residual", "norm_gate": "gate"} if mode == "epilogue"
                else dict.fromkeys(("norm", "residual", "norm_gate"), "none"))
            got = model(tokens, pos)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert all(m.decode_config is None and m.decode_fusion == "none" for m in linears)


@pytest.mark.parametrize("rope", [False, True])
def test_decode_attention_reads_only_the_slices_it_wrote(monkeypatch: pytest.MonkeyPatch, rope: bool) -> None:
    """The partial kernel writes nothing for the slices past the filled length and for its padding rows,
    and the merge must not read them: with the scratch buffers starting as NaN, the result is still the
    model's (a read of an unwritten partial would make it NaN)."""
    from trtbuild.kernels import decode_attention

    real_empty = torch.empty

    def nan_empty(*shape: object, **kw: object) -> torch.Tensor:
        t = real_empty(*shape, **kw)  # type: ignore[call-overload]
        return t.fill_(float("nan")) if t.is_floating_point() else t

    g = torch.Generator().manual_seed(7)
    batch, heads, kv_heads, d, pos = 1, 8, 2, 16, 40  # 32 slices, 2 of them filled: 30 never written
    k_cache, v_cache = (torch.randn(batch, kv_heads, 64, d, generator=g).to(DEVICE) for _ in range(2))
    p = torch.tensor([pos], device=DEVICE)
    if rope:
        table = torch.rand(64, d // 2, 2, generator=g).to(DEVICE)
        qkv = torch.randn(batch, 1, (heads + 2 * kv_heads) * d, generator=g).to(DEVICE)
        want = decode_attention.decode_attention_rope(qkv, table, k_cache.clone(), v_cache.clone(), p, heads)
        monkeypatch.setattr(torch, "empty", nan_empty)
        got = decode_attention.decode_attention_rope(qkv, table, k_cache.clone(), v_cache.clone(), p, heads)
    else:
        q = torch.randn(batch, 1, heads, d, generator=g).to(DEVICE)
        want = decode_attention.decode_attention(q, k_cache, v_cache, p)
        monkeypatch.setattr(torch, "empty", nan_empty)
        got = decode_attention.decode_attention(q, k_cache, v_cache, p)
    monkeypatch.undo()
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_the_matmul_probe_times_extra_configurations_beside_the_builds_and_plans_the_step_with_the_fastest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/probes/matmul_probe.py's bookkeeping, dry-run on the tiny recipe: the build's candidates (one here)
    through `select`, then the extra configurations, each launched and judged against ATen: the one-row set
    at batch 1, the other at batch 2. The stand-in clock makes every timing
    faster than the one before, so the last extra configuration must be the fastest way for every shape
    and the `best` step must use it."""
    from trtbuild.kernels import decode_matmul as dm

    probe = benchmark_module("matmul_probe")
    clock = iter(range(10_000, 0, -1))

    def fake_graph_seconds(calls: object, reps: int = 15) -> float:
        calls()  # type: ignore[operator]  # the launches run (through the interpreter); only the clock is fake
        return next(clock) * 1e-6

    monkeypatch.setattr(probe, "DEVICE", DEVICE)
    monkeypatch.setattr(probe, "DTYPE", torch.float32)
    monkeypatch.setattr(probe, "graph_seconds", fake_graph_seconds)
    monkeypatch.setattr(dm, "graph_seconds", fake_graph_seconds)
    monkeypatch.setattr(dm, "candidates", lambda rows, fusion="none", split=False, k=0, n=0: [dm.MatmulConfig(8, 32, 4, 1)])
    extra = {"one": probe.parse_configs("n4k64w4s1,n2k128w8s3")["one"], "rows": [dm.MatmulConfig(16, 64, 4, 2)]}
    saved: list[int] = []  # after each batch of each timing, what is measured so far goes to `save`
    out = probe.probe_recipe(str(ROOT / "recipes" / "tiny-llama.yaml"), [1, 2], 1, extra,
                             save=lambda partial: saved.append(len(partial["step"])))
    assert saved == [1, 2]  # batches with their plans timed so far

    for name, row in out["shapes"]["1"].items():
        assert set(row["extra"]) == {"n4k64w4s1", "n2k128w8s3"}, name
        assert all(isinstance(us, float) for us in row["extra"].values()), row["extra"]
        assert row["best"] == "n2k128w8s3", name
    assert out["step"]["1"]["best"]["choice"] == dict.fromkeys(out["fusion"], "n2k128w8s3")
    # at batch 2 the "rows" set: the tensor-core path's configuration, timed and (the clock says) fastest
    assert all(list(row["extra"]) == ["n16k64w4s2"] and isinstance(row["extra"]["n16k64w4s2"], float)
               for row in out["shapes"]["2"].values())
    assert out["step"]["2"]["best"]["choice"] == dict.fromkeys(out["fusion"], "n16k64w4s2")
    assert out["step"]["1"]["selected"]["choice"]["qkv"] == "n8k32w4s1"


@pytest.mark.parametrize("fusion", ["none", "residual", "gate"])
def test_the_matmul_probe_refuses_an_extra_configuration_whose_result_differs_from_atens(
        monkeypatch: pytest.MonkeyPatch, fusion: str) -> None:
    """An extra configuration is timed with the call site's fusion only once its output matches ATen's."""
    from trtbuild.kernels import decode_matmul as dm

    probe = benchmark_module("matmul_probe")
    monkeypatch.setattr(probe, "graph_seconds", lambda calls, reps=15: (calls(), 5e-6)[1])
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(48 if fusion == "gate" else 24, 40, generator=g).to(DEVICE) for _ in range(2)]
    config = dm.MatmulConfig(8, 16, 4, 1)
    assert probe.time_config(weights, 1, fusion, config, 1) == pytest.approx(2.5)  # 5 us / 2 matrices
    monkeypatch.setattr(probe, "reference", lambda *args: dm.reference(*args) * 1.5)  # 33% off, whatever the scale
    assert str(probe.time_config(weights, 1, fusion, config, 1)).startswith("refused: max relative error")


def test_the_matmul_probe_takes_configuration_names_or_wide_and_names_a_bad_one() -> None:
    probe = benchmark_module("matmul_probe")
    assert probe.parse_configs("") == {} and probe.parse_configs("wide") == {"one": probe.WIDE, "rows": probe.WIDE_ROWS}
    named = probe.parse_configs("n4k2048w4s3,n2k4096w8s1")
    assert [c.name for c in named["one"]] == ["n4k2048w4s3", "n2k4096w8s1"] and named["rows"] == named["one"]
    assert all(c.block_n >= 16 for c in probe.WIDE_ROWS)  # the tensor-core path's smallest block
    for bad, why in (("n3k2048w4s1", "powers of two"), ("n4k2048w4s1p2", "no split-K"), ("n4x", "configuration name")):
        with pytest.raises(SystemExit, match=why):
            probe.parse_configs(f"n4k1024w4s1,{bad}")


def test_decode_attention_serves_each_sequence_at_its_own_position_in_its_own_cache_row() -> None:
    """A ragged batch in one launch: three sequences at positions 0, 40 and 250 in cache rows 2, 0 and 3 (row 1
    and the rest of each row untouched) give what each gets alone through the model's ATen code: its query and
    new key rotated by its own rope row, its key and value stored at its own slot of its own row, attention over
    its own slots 0..pos only."""
    from trtbuild.kernels.decode_attention import decode_attention_rope
    from trtbuild.models.llama import LlamaConfig, _cached_attention, rope_and_store, rope_table

    heads, kv_heads, d, n_slots = 8, 2, 16, 300
    cfg = LlamaConfig(vocab_size=8, hidden_size=heads * d, intermediate_size=8, num_layers=1, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=d, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                      tie_word_embeddings=True, qkv_bias=False, o_bias=False, mlp_bias=False)
    rope = rope_table(cfg, n_slots).to(DEVICE)
    g = torch.Generator().manual_seed(3)
    positions, rows = [0, 40, 250], [2, 0, 3]
    qkv = torch.randn(3, 1, (heads + 2 * kv_heads) * d, generator=g).to(DEVICE)
    k_cache, v_cache = (torch.randn(5, kv_heads, n_slots, d, generator=g).to(DEVICE) for _ in range(2))
    k_want, v_want = k_cache.clone(), v_cache.clone()
    wants = []
    for i, (p, r) in enumerate(zip(positions, rows)):
        pos, slot = torch.tensor([[p]], device=DEVICE), torch.tensor([r], device=DEVICE)
        q, _, _ = rope_and_store(qkv[i:i + 1], rope[pos], pos, slot, k_want, v_want, cfg)
        wants.append(_cached_attention(q.transpose(1, 2), k_want[r:r + 1], v_want[r:r + 1], pos,
                                       torch.arange(p + 1, device=DEVICE)).transpose(1, 2))
    got = decode_attention_rope(qkv, rope, k_cache, v_cache, torch.tensor(positions, device=DEVICE), heads,
                                slots=torch.tensor(rows, device=DEVICE))
    torch.testing.assert_close(k_cache, k_want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(v_cache, v_want, atol=0, rtol=0)
    torch.testing.assert_close(got, torch.cat(wants), atol=1e-5, rtol=1e-5)


def test_decode_attention_without_rope_reads_each_sequence_from_its_own_row_to_its_own_position() -> None:
    """The kernel without rope and the cache writes, with per-sequence positions and cache rows."""
    from trtbuild.kernels.decode_attention import decode_attention
    from trtbuild.models.llama import _cached_attention

    g = torch.Generator().manual_seed(5)
    heads, kv_heads, d = 6, 2, 16
    positions, rows = [7, 130, 0, 64], [1, 4, 0, 2]
    q = torch.randn(4, 1, heads, d, generator=g).to(DEVICE)
    k_cache, v_cache = (torch.randn(5, kv_heads, 200, d, generator=g).to(DEVICE) for _ in range(2))
    got = decode_attention(q, k_cache, v_cache, torch.tensor(positions, device=DEVICE), torch.tensor(rows, device=DEVICE))
    for i, (p, r) in enumerate(zip(positions, rows)):
        want = _cached_attention(q[i:i + 1].transpose(1, 2), k_cache[r:r + 1], v_cache[r:r + 1],
                                 torch.tensor([p], device=DEVICE), torch.arange(p + 1, device=DEVICE)).transpose(1, 2)
        torch.testing.assert_close(got[i:i + 1], want, atol=1e-5, rtol=1e-5)


def test_ragged_decode_steps_through_the_kernel_give_the_logits_of_the_aten_model() -> None:
    """Decode steps of sequences at different positions, in cache rows other than their batch index (the slot
    API's steps), routed through the kernel: the logits of the unrouted model, step after step."""
    from trtbuild.backends.torch.decode_kernels import routed
    from trtbuild.models.llama import LlamaConfig, Transformer

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=True,
                      qkv_bias=False, o_bias=False, mlp_bias=False)
    torch.manual_seed(0)
    models = [Transformer(cfg, max_batch_size=3, max_seq_len=24, dtype=torch.float32).to(DEVICE) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    lengths, rows = [3, 9], [2, 0]
    tokens = []
    for m in models:
        last = []
        for n, r in zip(lengths, rows):
            prompt = torch.arange(1, n + 1, device=DEVICE)[None] % 64
            last.append(m(prompt, torch.arange(n, device=DEVICE), from_start=True,
                          slots=torch.tensor([r], device=DEVICE)).argmax(-1))
        tokens.append(torch.stack(last))
    slots = torch.tensor(rows, device=DEVICE)
    for step in range(4):
        pos = torch.tensor(lengths, device=DEVICE)[:, None] + step
        want = models[0](tokens[0], pos, slots=slots)
        with routed(models[1], {}, "kernel"):
            got = models[1](tokens[0], pos, slots=slots)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        tokens[0] = want.argmax(-1, keepdim=True)
