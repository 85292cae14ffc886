"""The paged attention kernel (kernels/paged_attention.py) on the CPU, through Triton's interpreter, against the
model's ATen paged attention: rows of very different lengths in scattered blocks, grouped queries, partial last
blocks, prompt chunks of several tokens. Skipped where Triton is not installed. fp32 throughout: the
interpreter's bf16 dot is not reliable."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # read when the kernels are defined, so before they are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from tests.conftest import TINY_CONFIG, run_compiled_triton  # noqa: E402 - after the interpreter is chosen
from trtbuild.models import llama  # noqa: E402
from trtbuild.models.paged import BLOCK, PagedStep, pool_shape  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _cfg(heads: int, kv_heads: int, head_dim: int = 16) -> llama.LlamaConfig:
    return llama.LlamaConfig.from_hf(dict(TINY_CONFIG, hidden_size=heads * head_dim, num_attention_heads=heads,
                                          num_key_value_heads=kv_heads, max_position_embeddings=1024))


def _alone(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pos: torch.Tensor, tables: torch.Tensor,
           i: int) -> torch.Tensor:
    """Row i's one-token attention by ATen over its blocks gathered into a contiguous cache (two KV heads of 16)."""
    keys = k_pool[tables[i]].transpose(0, 1).reshape(1, 2, -1, 16)
    values = v_pool[tables[i]].transpose(0, 1).reshape(1, 2, -1, 16)
    return llama._cached_attention(q[i:i + 1].transpose(1, 2), keys, values, pos[i:i + 1],
                                   torch.arange(int(pos[i, 0]) + 1, device=DEVICE)).transpose(1, 2)


def _scattered_tables(lengths: list[int], num_blocks: int, seed: int) -> list[list[int]]:
    """Each row's blocks, drawn without repeats from one shuffled pool: rows interleave in it."""
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for n in lengths:
        need = -(-n // BLOCK)
        tables.append(order[used:used + need])
        used += need
    return tables


@pytest.mark.parametrize(("heads", "kv_heads", "positions"), [
    (4, 2, [[0], [15], [16], [300], [47]]),  # first slot, a full block, one past it, several slices, mid-block
    (8, 1, [[1000], [3]]),  # one KV head for eight queries; a long row beside a short one
    (6, 2, [[33], [700]]),  # three queries a KV head (not a power of two)
    (4, 4, [[0, 1, 2, 3, 4, 5, 6], [100, 101, 102, 103, 104, 105, 106]]),  # prompt chunks: one tile and a partial one
    (16, 2, [[40, 41, 42], [512, 513, 514]]),  # eight queries a KV head: two tokens a tile
    (16, 1, [[20], [250]]),  # sixteen queries a KV head: one token fills a tile
    # the chunk kernel's tiles of 64 rows: 16 tokens of four heads, three tiles and a partial one, after a context
    (4, 1, [list(range(100, 140)), list(range(0, 40))]),
    (2, 2, [list(range(30, 100))]),  # one query a KV head: 64 tokens a tile, a second tile of six
])
def test_the_kernel_gives_the_aten_paged_attention(monkeypatch: pytest.MonkeyPatch, heads: int, kv_heads: int,
                                                   positions: list[list[int]]) -> None:
    """The same step through `llama.paged_attention` with the kernel and without: the same pools written, the
    same output. Tables are padded to the widest row with blocks no row owns (masked past each position)."""
    cfg = _cfg(heads, kv_heads)
    attn = llama.Attention(cfg).to(DEVICE)
    g = torch.Generator().manual_seed(heads * 31 + len(positions[0]))
    b, t = len(positions), len(positions[0])
    pos = torch.tensor(positions, device=DEVICE)
    lengths = [row[-1] + 1 for row in positions]
    num_blocks = sum(-(-n // BLOCK) for n in lengths) + 3
    tables = _scattered_tables(lengths, num_blocks, heads)
    width = max(len(x) for x in tables)
    spare = num_blocks - 1  # past every row's blocks: padding that must never be read
    blocks = torch.tensor([x + [spare] * (width - len(x)) for x in tables], device=DEVICE)
    qkv = torch.randn(b, t, (heads + 2 * kv_heads) * cfg.head_dim, generator=g).to(DEVICE)
    rope = llama.rope_table(cfg, 1024).to(DEVICE)
    pools = [torch.randn(pool_shape(cfg, num_blocks), generator=g).to(DEVICE) for _ in range(2)]
    results = {}
    for kernel in (False, True):
        monkeypatch.setattr(llama, "paged_kernel", lambda cfg, pool, on=kernel: on)
        k_pool, v_pool = (p.clone() for p in pools)
        y = llama.paged_attention(attn, qkv, rope[pos], pos, blocks, k_pool, v_pool)
        results[kernel] = (y, k_pool, v_pool)
    (want, *want_pools), (got, *got_pools) = results[False], results[True]
    for w, gp in zip(want_pools, got_pools):
        torch.testing.assert_close(gp, w, atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_kernel_reads_only_the_slices_it_wrote(monkeypatch: pytest.MonkeyPatch) -> None:
    """The partial kernel writes no partials for empty slices and padding rows, and the merge must not read
    them: with the scratch buffers starting as NaN, the output is still finite and right."""
    from trtbuild.kernels import paged_attention as pa

    real_empty = torch.empty
    monkeypatch.setattr(pa.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    cfg = _cfg(4, 2)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 1, 4, 16, generator=g).to(DEVICE)
    k_pool, v_pool = (torch.randn(pool_shape(cfg, 40), generator=g).to(DEVICE) for _ in range(2))
    pos = torch.tensor([[2], [200], [17]], device=DEVICE)
    tables = torch.tensor([[5] + [39] * 12, list(range(13)), [20, 21] + [39] * 11], device=DEVICE)
    got = pa.paged_attention(q, k_pool, v_pool, pos, tables)
    assert torch.isfinite(got).all()
    for i in range(3):  # each row alone, its blocks gathered: ATen's attention over a contiguous cache
        torch.testing.assert_close(got[i:i + 1], _alone(q, k_pool, v_pool, pos, tables, i), atol=1e-5, rtol=1e-5)


def test_a_paged_model_through_the_kernel_decodes_as_through_aten(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked prefill of two prompts of different lengths, then decode steps of both rows together, with every
    layer's paged attention through the kernel: the logits of the ATen paged path, step after step, so what
    the kernel reads is what the step wrote."""
    cfg = _cfg(4, 2)
    torch.manual_seed(0)
    model = llama.Transformer(cfg, max_batch_size=1, max_seq_len=128, dtype=torch.float32).to(DEVICE).eval()
    step = PagedStep(model)
    prompts = [[(7 * i + 3) % cfg.vocab_size for i in range(37)], [(5 * i + 1) % cfg.vocab_size for i in range(5)]]
    tables = [[9, 2, 6, 0, 11], [4, 10, 1, 7]]
    logs: dict[bool, list[torch.Tensor]] = {}
    for kernel in (False, True):
        monkeypatch.setattr(llama, "paged_kernel", lambda cfg, pool, on=kernel: on)
        pools = [torch.zeros(pool_shape(cfg, 12), device=DEVICE) for _ in range(2 * cfg.num_layers)]
        out: list[torch.Tensor] = []
        last = []
        with torch.no_grad():
            for r, (prompt, chunks) in enumerate(zip(prompts, ([0, 16, 21, 37], [0, 5]))):
                for a, b in zip(chunks, chunks[1:]):
                    used = max(2, -(-b // BLOCK))
                    _, logits = step(torch.tensor([prompt[a:b]], device=DEVICE),
                                     torch.arange(a, b, device=DEVICE)[None],
                                     torch.tensor([tables[r][:used]], device=DEVICE), *pools)
                    out.append(logits)
                last.append(int(logits[0].argmax()))
            for i in range(6):
                positions = [len(p) + i for p in prompts]
                blocks = torch.tensor([x[:4] for x in tables], device=DEVICE)
                _, logits = step(torch.tensor(last, device=DEVICE)[:, None],
                                 torch.tensor(positions, device=DEVICE)[:, None], blocks, *pools)
                out.append(logits)
                last = logits.argmax(-1).tolist()
        logs[kernel] = out
    for got, want in zip(logs[True], logs[False], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_kernel_is_used_only_on_cuda_for_the_models_it_serves() -> None:
    from trtbuild.kernels.paged_attention import supports

    cfg = _cfg(4, 2)
    assert not llama.paged_kernel(cfg, torch.zeros(1, dtype=torch.bfloat16))  # the CPU keeps ATen's
    assert supports(cfg, torch.bfloat16) is None and supports(cfg, torch.float16) is None
    assert "tf32" in (supports(cfg, torch.float32) or "")
    assert "head_dim" in (supports(_cfg(4, 2, head_dim=8), torch.bfloat16) or "")
    assert "windows" in (supports(replace(cfg, layer_windows=(8, 0)), torch.bfloat16) or "")
    assert "soft-capped" in (supports(replace(cfg, attn_softcap=50.0), torch.bfloat16) or "")


def test_the_paged_graph_exports_the_kernel_as_one_opaque_op_a_layer_with_rows_and_tokens_dynamic(
        tmp_path: Path) -> None:
    """`export.export_paged` with the kernel in (as on CUDA): trtbuild::paged_attention once a layer, what
    AOTInductor compiles in, the rows, tokens, table width and pool still dynamic (one graph serves every
    bucket), and the compiled-graph cache's key takes the kernel's source digest. In a process of its own:
    export traces the op's kernel launch only where Triton's interpreter is off."""
    script = tmp_path / "export_paged.py"
    script.write_text(
        "import os\n"
        "os.environ.pop('TRITON_INTERPRET', None)\n"
        "import torch\n"
        "from tests.conftest import TINY_CONFIG\n"
        "from trtbuild.models import llama\n"
        "from trtbuild.backends.torch.decode_kernels import sources_called\n"
        "from trtbuild.backends.torch.export import export_paged\n"
        "from trtbuild.kernels.paged_attention import source_digest\n"
        "llama.paged_kernel = lambda cfg, pool: True\n"
        "cfg = llama.LlamaConfig.from_hf(dict(TINY_CONFIG, hidden_size=64, max_position_embeddings=128))\n"
        "model = llama.Transformer(cfg, max_batch_size=1, max_seq_len=128, dtype=torch.float32).eval()\n"
        "ep = export_paged(model, 32, 128, 'cpu')\n"
        "text = ep.graph_module.print_readable(print_output=False)\n"
        "assert text.count('torch.ops.trtbuild.paged_attention.default(') == cfg.num_layers, text\n"
        "ranges = sorted((r.lower, r.upper) for r in ep.range_constraints.values())\n"
        "assert ranges == [(1, 32), (1, 256), (2, 8), (2, 2**24)], ranges\n"
        "assert sources_called(text) == '\\0trtbuild.paged_attention ' + source_digest()\n"
        "print('ok')\n")
    run_compiled_triton(script)


@pytest.mark.parametrize("programs", [4, 24])
def test_fewer_slices_where_rows_fill_the_device(monkeypatch: pytest.MonkeyPatch, programs: int) -> None:
    """With many rows a decode step needs no slicing to fill the device: the slices a row gets fall to
    PROGRAMS / (rows x KV heads), one (4) or four (24) here for three rows of two KV heads, and the output is
    still the ATen attention's."""
    from trtbuild.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "PROGRAMS", programs)
    cfg = _cfg(4, 2)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, 1, 4, 16, generator=g).to(DEVICE)
    k_pool, v_pool = (torch.randn(pool_shape(cfg, 40), generator=g).to(DEVICE) for _ in range(2))
    pos = torch.tensor([[2], [200], [97]], device=DEVICE)
    tables = torch.tensor([[5] + [39] * 12, list(range(13)), [20, 21, 22, 23, 24, 25, 26] + [39] * 6], device=DEVICE)
    got = pa.paged_attention(q, k_pool, v_pool, pos, tables)
    for i in range(3):
        torch.testing.assert_close(got[i:i + 1], _alone(q, k_pool, v_pool, pos, tables, i), atol=1e-5, rtol=1e-5)
