"""The paged decode step's CUDA-graph buckets (backends/torch/paged_graphs.py) on the CPU: which bucket a step
takes, how its static buffers are filled and padded, and that a padded step computes what the direct call does
while writing nothing outside its rows' blocks and the scratch block. The capture itself is in test_gpu.py."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_tiny_model
from trtbuild.backends.torch.paged_graphs import PagedDecodeGraphs, bucket_for, buckets
from trtbuild.backends.torch.paged_runtime import PagedCache
from trtbuild.errors import InputError
from trtbuild.models.paged import BLOCK, PagedStep


def test_buckets_are_powers_of_two_up_to_the_first_that_holds_the_most_rows() -> None:
    assert buckets(1) == [1]
    assert buckets(5) == [1, 2, 4, 8]
    assert buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert [bucket_for(n, buckets(256)) for n in (1, 2, 3, 5, 129, 256)] == [1, 2, 4, 8, 256, 256]
    with pytest.raises(InputError, match="past the paged graphs' 8"):
        bucket_for(9, buckets(5))


def test_the_static_buffers_hold_the_rows_then_padding_rows_on_the_scratch_block() -> None:
    graphs = PagedDecodeGraphs(None, [], "cpu", width=5, scratch=99, max_rows=8)
    host = graphs.host_rows(4, [[3, 7], [1], [4, 5, 6]], [11, 12, 13], [20, 5, 40])
    tok, pos, tables = graphs.inputs[4]
    graphs.io[4].copy_(host)
    assert tok[:, 0].tolist() == [11, 12, 13, 0] and pos[:, 0].tolist() == [20, 5, 40, 0]
    assert tables.tolist() == [[3, 7, 99, 99, 99], [1, 99, 99, 99, 99], [4, 5, 6, 99, 99], [99] * 5]
    for t in (tok, pos, tables):  # each input contiguous and 16-byte aligned in the one buffer
        assert t.is_contiguous() and (t.data_ptr() - graphs.io[4].data_ptr()) % 16 == 0
    with pytest.raises(InputError, match="wider than"):
        graphs.host_rows(4, [[1] * 6], [1], [90])


def test_a_padded_bucket_step_gives_the_direct_steps_logits_and_writes_only_its_rows_and_the_scratch() -> None:
    """Three rows at very different lengths run in the 4-row bucket (full-width tables, one padding row) and
    directly (tables as wide as the longest row): the same greedy tokens and logits, and the same pools but
    for the scratch block, which only the padding row wrote."""
    model = random_tiny_model(max_batch_size=1)
    cfg, step = model.cfg, PagedStep(model)
    direct = PagedCache(step, cfg, 20, torch.float32, "cpu", 96, graphs=False)
    assert direct.graphs is None and direct.scratch == 20 and direct.pools[0].shape[0] == 21
    g = torch.Generator().manual_seed(1)
    for pool in direct.pools:
        pool.copy_(torch.randn(pool.shape, generator=g))
    padded = PagedDecodeGraphs(step, [p.clone() for p in direct.pools], "cpu", direct.max_blocks, direct.scratch,
                               max_rows=20)
    tables = [[3, 9, 0, 14, 2], [7], [11, 5]]
    positions, tokens = [70, 3, 16], [5, 9, 17]
    want_greedy, want_logits = direct.decode(tables, tokens, positions)
    rows = [t[:-(-(p + 1) // BLOCK)] for t, p in zip(tables, positions)]
    greedy, logits = padded.run(rows, tokens, positions)
    assert sorted(padded.inputs) == [4] and not padded.graphs  # the CPU captures nothing
    torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
    assert greedy.tolist() == want_greedy.tolist()
    for got, want in zip(padded.pools, direct.pools):
        # another batch shape may round the projections differently (an AMD EPYC CPU did)
        torch.testing.assert_close(got[:20], want[:20], atol=1e-6, rtol=1e-5)
        assert not torch.equal(got[20], want[20])  # the padding row wrote its position 0 there


def test_bucket_graphs_only_where_the_graph_attends_through_the_paged_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU (and a CUDA model the kernel does not serve) calls the package directly: the ATen gather reads a
    table's every entry, so full-width tables would cost it a full-length read a row. Where the kernel serves,
    the buckets reach the paged graph's 256 rows or the pool's blocks, whichever is fewer."""
    from trtbuild.models import llama

    model = random_tiny_model(max_batch_size=1)
    assert PagedCache(PagedStep(model), model.cfg, 8, torch.float32, "cpu", 96).graphs is None
    monkeypatch.setattr(llama, "paged_kernel", lambda cfg, pool: True)
    graphs = PagedCache(PagedStep(model), model.cfg, 40, torch.float32, "cpu", 96).graphs
    assert graphs is not None and graphs.sizes[-1] == 64 and graphs.width == 6 and graphs.scratch == 40
    assert PagedCache(PagedStep(model), model.cfg, 9000, torch.float32, "cpu", 96).graphs.sizes[-1] == 256
    assert PagedCache(PagedStep(model), model.cfg, 8, torch.float32, "cpu", 16).graphs.width == 2


def test_capture_all_captures_each_bucket_once_and_nothing_off_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server captures every bucket before it is ready, so no request's step pays a capture; a bucket already
    captured is not captured again, and the CPU captures nothing."""
    cpu = PagedDecodeGraphs(None, [], "cpu", width=4, scratch=9, max_rows=5)
    cpu.capture_all()
    assert not cpu.graphs
    graphs = PagedDecodeGraphs(None, [], "cuda:0", width=4, scratch=9, max_rows=5)
    captured: list[int] = []
    monkeypatch.setattr(graphs, "_capture", lambda size: (captured.append(size), graphs.graphs.setdefault(size, 0)))
    graphs.graphs[2] = object()  # captured by an earlier step
    graphs.capture_all()
    assert captured == [1, 4, 8] and sorted(graphs.graphs) == [1, 2, 4, 8]


def test_the_bucket_path_of_the_cache_decodes_as_the_direct_one_and_refuses_bad_tables(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """PagedCache.decode through the buckets (tables cut to the blocks through each row's position, however
    many the row holds) gives the direct call's tokens; a table short of its position, or naming a block
    outside the pool, is refused with the row or the pool named."""
    from trtbuild.models import llama

    model = random_tiny_model(max_batch_size=1)
    cfg, step = model.cfg, PagedStep(model)
    direct = PagedCache(step, cfg, 20, torch.float32, "cpu", 96, graphs=False)
    monkeypatch.setattr(llama, "paged_kernel", lambda cfg, pool: True)
    bucketed = PagedCache(step, cfg, 20, torch.float32, "cpu", 96)
    monkeypatch.undo()  # the buckets are made; the model attends with ATen ops on the CPU
    assert bucketed.graphs is not None
    g = torch.Generator().manual_seed(2)
    for a, b in zip(direct.pools, bucketed.pools):
        a.copy_(torch.randn(a.shape, generator=g))
        b.copy_(a)
    tables, tokens, positions = [[3, 9, 0, 14, 2, 6], [7, 1], [11, 5]], [5, 9, 17], [70, 3, 16]  # rows hold spares
    want, _ = direct.decode(tables, tokens, positions)
    got, _ = bucketed.decode(tables, tokens, positions)
    assert got.tolist() == want.tolist()
    with pytest.raises(InputError, match="row 1's block table of 1 blocks does not reach its position 16"):
        bucketed.decode([[3, 9], [7]], [1, 2], [3, 16])
    with pytest.raises(InputError, match="outside the pool's 20"):
        bucketed.decode([[3, 20]], [1], [17])


def test_chunk_buckets_hold_at_most_512_tokens_and_a_larger_call_goes_direct() -> None:
    from trtbuild.backends.torch.paged_graphs import PagedChunkGraphs, chunk_buckets

    assert chunk_buckets(64) == [(1, 16), (1, 32), (1, 64), (2, 16), (2, 32), (2, 64), (4, 16), (4, 32), (4, 64),
                                 (8, 16), (8, 32), (8, 64)]
    assert max(r * t for r, t in chunk_buckets(4096)) == 512
    graphs = PagedChunkGraphs(None, [], "cpu", width=6, scratch=40, max_seq_len=96, max_input_len=64, block=BLOCK)
    assert graphs.bucket(3, 10) == (4, 16) and graphs.bucket(1, 33) == (1, 64)
    assert graphs.bucket(9, 4) is None and graphs.bucket(2, 65) is None
    # a row at the end of the engine's length has no room for its padding: the caller calls directly
    assert graphs.host_rows((2, 32), [[0, 1, 2, 3, 4, 5], [6]], [[1] * 4, [2] * 32], [88, 0]) is None


def test_a_chunk_bucket_gives_the_direct_calls_logits_and_writes_only_its_rows_and_the_scratch() -> None:
    """Three requests' chunks (after a context, from the start, mid-block) in the (4, 16) bucket, each left-padded
    onto the scratch block, beside one direct call each: the same logits and greedy tokens, and the same pools
    but for the scratch block."""
    from trtbuild.backends.torch.paged_graphs import PagedChunkGraphs

    model = random_tiny_model(max_batch_size=1)
    cfg, step = model.cfg, PagedStep(model)
    direct = PagedCache(step, cfg, 20, torch.float32, "cpu", 96, graphs=False)
    g = torch.Generator().manual_seed(2)
    for pool in direct.pools:
        pool.copy_(torch.randn(pool.shape, generator=g))
    padded = PagedChunkGraphs(step, [p.clone() for p in direct.pools], "cpu", direct.max_blocks, direct.scratch,
                              96, 64, BLOCK)
    tables, starts = [[3, 9, 0], [7], [11, 5, 2, 6]], [16, 0, 40]
    chunks = [[5, 1, 4, 1, 5], [(3 * i) % cfg.vocab_size for i in range(12)], [8, 2, 7]]
    want = [direct.prefill(t, c, s) for t, c, s in zip(tables, chunks, starts)]
    greedy, logits = padded.run(tables, chunks, starts)
    assert sorted(padded.inputs) == [(4, 16)] and not padded.graphs  # the CPU captures nothing
    torch.testing.assert_close(logits, torch.cat([lg for _, lg in want]), atol=1e-5, rtol=1e-5)
    assert greedy.tolist() == torch.cat([gr for gr, _ in want]).tolist()
    for got, exp in zip(padded.pools, direct.pools):
        torch.testing.assert_close(got[:20], exp[:20], atol=1e-6, rtol=1e-5)
    # the many-chunk call without buckets (the CPU's path, and a call too large for one) agrees as well
    many = PagedCache(step, cfg, 20, torch.float32, "cpu", 96, graphs=False)
    for mine, theirs in zip(many.pools, padded.pools):
        mine.copy_(theirs)
    greedy2, logits2 = many.prefill_many(tables, chunks, starts)
    torch.testing.assert_close(logits2, logits, atol=1e-5, rtol=1e-5)


def test_chunks_in_one_call_equal_one_call_each_and_their_padding_touches_only_the_scratch_block() -> None:
    """PagedCache.prefill_many, the direct path (the CPU's, and a call too large for a bucket): a short chunk in
    a request's first block beside a longer one is padded past that block, onto the scratch block; its keys and
    values, its logits and every other block are those of one call each."""
    model = random_tiny_model(max_batch_size=1)
    cfg, step = model.cfg, PagedStep(model)
    one, many = (PagedCache(step, cfg, 20, torch.float32, "cpu", 96, graphs=False) for _ in range(2))
    g = torch.Generator().manual_seed(3)
    for a, b in zip(one.pools, many.pools):
        a.copy_(torch.randn(a.shape, generator=g))
        b.copy_(a)
    tables, starts = [[4], [7, 8, 2], [12]], [0, 0, 5]
    chunks = [[9, 3, 1], [(5 * i) % cfg.vocab_size for i in range(40)], [6, 6, 2, 8]]
    want = [one.prefill(t, c, s) for t, c, s in zip(tables, chunks, starts)]
    greedy, logits = many.prefill_many(tables, chunks, starts)
    torch.testing.assert_close(logits, torch.cat([lg for _, lg in want]), atol=1e-5, rtol=1e-5)
    assert greedy.tolist() == torch.cat([gr for gr, _ in want]).tolist()
    for a, b in zip(one.pools, many.pools):
        torch.testing.assert_close(b[:20], a[:20], atol=1e-6, rtol=1e-5)


def test_every_direct_call_hands_the_graph_contiguous_16_byte_aligned_inputs() -> None:
    """AOTInductor compiles a graph for inputs aligned to 16 bytes and copies a view off that alignment, every
    call (with a warning). Odd row counts and odd chunk lengths put the old single buffer's views off it; the
    chunk rows were strided views. Every input the prompt, decode and mixed calls pass is checked."""
    seen: list[list[torch.Tensor]] = []

    class Recorder:
        def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            seen.append(list(inputs[:6]))
            n = inputs[0].shape[0] + (inputs[3].shape[0] if len(inputs) > 6 and inputs[3].dim() == 2 else 0)
            return torch.zeros(n, 1, dtype=torch.long), torch.zeros(n, 4)

    model = random_tiny_model(max_batch_size=1)
    cache = PagedCache(Recorder(), model.cfg, 20, torch.float32, "cpu", 96, graphs=False, mixed=Recorder())
    cache.prefill([3, 4], [5, 6, 7], 0)
    cache.prefill_many([[4], [7, 8, 2], [12]], [[9, 3, 1], [5] * 33, [6, 6, 2, 8]], [0, 0, 5])
    cache.decode([[3], [7, 1], [11]], [5, 9, 17], [3, 20, 7])
    cache.mixed([[3], [7, 1], [11]], [5, 9, 17], [3, 20, 7], [[4], [12, 13]], [[9, 3, 1], [6] * 5], [0, 16])
    assert len(seen) == 4
    for call in seen:
        for t in call:
            if t.dtype == torch.long:
                assert t.is_contiguous() and t.data_ptr() % 16 == 0, (t.shape, t.stride(), t.data_ptr() % 16)
    tokens, positions, tables = seen[1][:3]  # the chunk rows, left-padded to the longest, one row each
    assert tokens.shape == positions.shape == (3, 33) and tables.shape[0] == 3
    assert tokens[0, -3:].tolist() == [9, 3, 1] and positions[2, -4:].tolist() == [5, 6, 7, 8]


def test_mixed_buckets_pad_decode_rows_from_16_and_take_a_graph_only_with_little_chunk_padding() -> None:
    from trtbuild.backends.torch.mixed_graphs import MATMUL_FLOPS_PER_S, SAVED_S, PagedMixedGraphs, mixed_buckets

    sizes = mixed_buckets(256, 4096)
    assert sorted({d for d, _, _ in sizes}) == [16, 32, 64, 128, 256]
    assert {(r, t) for _, r, t in sizes} >= {(1, 32), (1, 512), (2, 256), (8, 64)}
    assert all(r * t <= 512 and t >= 32 for _, r, t in sizes)
    assert sorted({d for d, _, _ in mixed_buckets(5, 64)}) == [8]  # a small pool's one bucket holds its rows
    # a model whose token costs as many FLOPs as 100 padded tokens may add to a call (SAVED_S at the rate)
    graphs = PagedMixedGraphs(None, [], "cpu", width=6, scratch=40, max_seq_len=4096, max_rows=256,
                              max_input_len=4096, block=BLOCK, token_flops=SAVED_S * MATMUL_FLOPS_PER_S / 100)
    assert graphs.most_padding == 100
    assert graphs.bucket(3, 1, 20) == (16, 1, 32)  # 13 decode rows and 12 tokens of padding
    assert graphs.bucket(60, 1, 500) == (64, 1, 512)
    assert graphs.bucket(65, 2, 250) == (128, 2, 256)  # 63 rows and 12 tokens
    assert graphs.bucket(65, 2, 200) is None and graphs.bucket(64, 1, 300) is None  # 175 and 212: direct
    assert graphs.bucket(64, 1, 700) is None and graphs.bucket(300, 1, 32) is None  # no bucket that large
    small = PagedMixedGraphs(None, [], "cpu", 6, 40, 4096, 256, 4096, BLOCK, token_flops=SAVED_S * MATMUL_FLOPS_PER_S / 600)
    assert small.bucket(64, 1, 300) == (64, 1, 512)  # a small model's padding costs less than the launches


def test_a_mixed_bucket_gives_the_direct_mixed_calls_tokens_and_writes_only_its_rows_and_the_scratch() -> None:
    """Three decode rows and two chunks (one after a context, one from the start) through the (16, 2, 32) bucket,
    every row and chunk padded onto the scratch block, beside the direct call of the mixed step: the same greedy
    tokens, the decode rows' first, and the same pools but for the scratch block. A token fed on the device
    (`feed`) replaces the host's."""
    from trtbuild.backends.torch.mixed_graphs import PagedMixedGraphs
    from trtbuild.models.paged import MixedStep

    model = random_tiny_model(max_batch_size=1)
    cfg, mixed = model.cfg, MixedStep(model)
    direct = PagedCache(PagedStep(model), cfg, 20, torch.float32, "cpu", 96, graphs=False, mixed=mixed)
    g = torch.Generator().manual_seed(4)
    for pool in direct.pools:
        pool.copy_(torch.randn(pool.shape, generator=g))
    padded = PagedMixedGraphs(mixed, [p.clone() for p in direct.pools], "cpu", direct.max_blocks, direct.scratch,
                              96, 20, 64, BLOCK, token_flops=1.0)
    tables, positions, tokens = [[3, 9, 0], [7], [11, 5]], [40, 3, 16], [5, 9, 17]
    ctables, starts = [[2, 6], [12, 13]], [16, 0]
    chunks = [[4, 1, 4, 2], [(3 * i) % cfg.vocab_size for i in range(21)]]
    want, _ = direct.mixed(tables, tokens, positions, ctables, chunks, starts)
    rows = [t[:-(-(p + 1) // BLOCK)] for t, p in zip(tables, positions)]

    def feed(column: torch.Tensor) -> None:
        column[1] = 9  # as the step before's output would: the host's token for row 1 was a placeholder

    greedy = padded.run(rows, [5, 0, 17], positions, ctables, chunks, starts, feed)
    assert sorted(padded.inputs) == [(16, 2, 32)] and not padded.graphs  # the CPU captures nothing
    assert greedy.tolist() == want.tolist() and greedy.shape == (5, 1)
    for got, exp in zip(padded.pools, direct.pools):
        torch.testing.assert_close(got[:20], exp[:20], atol=1e-6, rtol=1e-5)
    assert padded.run(rows, tokens, positions, [[2, 6]], [list(range(300))], [16]) is None  # past every bucket
    # a table longer than its row's position is cut at it; one that does not reach it is refused
    longer = [t + [15, 16] for t in rows]
    assert padded.run(longer, tokens, positions, ctables, chunks, starts).tolist() == want.tolist()
    with pytest.raises(InputError, match="does not reach its position 40"):
        padded.run([[3, 9]] + rows[1:], tokens, positions, ctables, chunks, starts)
