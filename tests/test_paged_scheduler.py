"""The scheduler over a paged KV cache: admission by blocks, chunked prefill, prefix caching, preemption.

The stand-in engine keeps its "KV" in a pool of blocks and reads every sequence back through the block table
it is handed, so a wrong table (a block shared that should not be, one overwritten while in use, a chunk
written at the wrong place) changes the tokens; each next token is a function of the whole sequence.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from trtbuild.serving.kv_blocks import BlockPool
from trtbuild.serving.scheduler import QueueFull, Scheduler

from .test_scheduler import req, run_until_idle

VOCAB = 97


def rule(seq: list[int]) -> int:
    h = 0
    for t in seq:
        h = (h * 131 + t + 1) % 1_000_003
    return h % VOCAB


def alone(prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(rule(seq))
        seq.append(out[-1])
    return out


class PagedStandIn:
    def __init__(self, num_blocks: int, block_size: int, rows: int = 8, max_input_len: int = 64,
                 max_seq_len: int = 96) -> None:
        self.max_batch_size, self.max_input_len, self.max_seq_len, self.vocab_size = rows, max_input_len, max_seq_len, VOCAB
        self.block_size = block_size
        self.pool: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.log: list[tuple[str, Any]] = []
        self.prefilled = 0  # prompt tokens computed (not taken from the prefix cache)
        self.calls: list[int] = []  # chunks in each prefill call
        self.shapes: list[tuple[int, int]] = []  # (chunks, the longest) of each prefill call

    def _write(self, blocks: list[int], pos: int, token: int) -> None:
        self.pool[blocks[pos // self.block_size]][pos % self.block_size] = token

    def _read(self, blocks: list[int], length: int) -> list[int]:
        out = [self.pool[blocks[p // self.block_size]][p % self.block_size] for p in range(length)]
        assert None not in out, "a position read before it was written"
        return out  # type: ignore[return-value]

    def prefill_paged(self, keys: list[int], blocks: list[list[int]], tokens: list[list[int]], starts: list[int],
                      sampling: list[Any], lasts: list[bool]) -> list[int | None]:
        self.calls.append(len(keys))
        self.shapes.append((len(keys), max(map(len, tokens))))
        out: list[int | None] = []
        for key, b, chunk, start, last in zip(keys, blocks, tokens, starts, lasts):
            for i, t in enumerate(chunk):
                self._write(b, start + i, t)
            self.prefilled += len(chunk)
            self.log.append(("prefill", key, len(chunk), last))
            # as the torch engine: no token (and no wait for the device) for a chunk whose token is not wanted
            out.append(rule(self._read(b, start + len(chunk))) if last else None)
        return out

    def decode_paged(self, keys: list[int], blocks: list[list[int]], tokens: list[int], positions: list[int],
                     sampling: list[Any]) -> list[int]:
        assert len(keys) <= self.max_batch_size
        self.log.append(("decode", list(keys)))
        out = []
        for b, t, p in zip(blocks, tokens, positions):
            self._write(b, p, t)
        for b, p in zip(blocks, positions):  # every write first: rows never see each other's blocks
            out.append(rule(self._read(b, p + 1)))
        return out

    def release(self, key: int) -> None:
        self.log.append(("release", key))


class MixedStandIn(PagedStandIn):
    """An engine with the mixed step: a step's decode rows and prompt chunks in one call (`step_paged`)."""

    can_mix = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mixed = 0  # calls that carried both
        self.declined = False  # answer None (the chunks cannot go with the rows), as the torch engine may

    def step_paged(self, decode: tuple[Any, ...], chunks: tuple[Any, ...]) -> tuple[list[int], list[int | None]] | None:
        if self.declined:
            return None
        assert not set(decode[0]) & set(chunks[0]), "a request both decodes and prefills in one step"
        self.mixed += 1
        return self.decode_paged(*decode), self.prefill_paged(*chunks)


STEP_DEVICE_S = 0.25e-3  # what a stand-in's launched step says it took on the device


class Launched:
    def __init__(self, engine: "LaunchStandIn", decoded: list[int], firsts: list[int | None]) -> None:
        self.engine, self.decoded, self.firsts = engine, decoded, firsts
        self.device_seconds: float | None = None  # known once read back, as the torch engine's

    def result(self) -> tuple[list[int], list[int | None]]:
        assert self.engine.unread[0] is self, "steps are read back in the order they were launched"
        self.engine.unread.pop(0)
        self.device_seconds = STEP_DEVICE_S
        return self.decoded, self.firsts


class LaunchStandIn(MixedStandIn):
    """An engine whose steps are launched, then read back (`launch_paged`), as the torch engine's on a GPU: the
    device runs calls in order, so each computes at launch here, but the host learns its tokens only from
    `result()`. A fed row's token is the last launched step's output, taken here, never the host's list (the
    scheduler's entry for it is stale). Any other call forgets the launched step, as the engine does."""

    can_overlap = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last: list[int] | None = None  # the last launched step's outputs: decode rows, then every chunk's
        self.unread: list[Launched] = []
        self.launches = 0
        self.ahead = 0  # launches made while the step before was still unread

    def launch_paged(self, decode: tuple[Any, ...], chunks: tuple[Any, ...] | None,
                     fed: list[tuple[int, int]]) -> Launched | None:
        keys, blocks, tokens, positions, sampling = decode
        if chunks is not None and self.declined:
            return None
        tokens = list(tokens)
        for i, j in fed:
            assert self.last is not None
            tokens[i] = self.last[j]
        self.launches += 1
        self.ahead += bool(self.unread)
        decoded = PagedStandIn.decode_paged(self, keys, blocks, tokens, positions, sampling)
        firsts: list[int | None] = []
        computed: list[int] = []  # the device computes every chunk's next token; the host reads only the last ones'
        if chunks is not None:
            self.mixed += 1
            out = PagedStandIn.prefill_paged(self, *chunks[:5], [True] * len(chunks[0]))
            computed = [t for t in out if t is not None]
            firsts = [t if last else None for t, last in zip(computed, chunks[5])]
        self.last = decoded + computed
        self.unread.append(Launched(self, decoded, firsts))
        return self.unread[-1]

    def prefill_paged(self, *args: Any) -> list[int | None]:
        self.last = None
        return super().prefill_paged(*args)

    def decode_paged(self, *args: Any) -> list[int]:
        self.last = None
        return super().decode_paged(*args)

    def step_paged(self, decode: tuple[Any, ...], chunks: tuple[Any, ...]) -> tuple[list[int], list[int | None]] | None:
        self.last = None
        return super().step_paged(decode, chunks)


class BucketStandIn(LaunchStandIn):
    """An engine whose steps replay captured prompt-chunk graphs of these (rows, tokens a row) shapes beside the
    decode rows (the torch engine's `chunk_buckets` under serve --captured-chunks)."""

    chunk_buckets = [(1, 4), (1, 8), (1, 16), (2, 4), (2, 8), (4, 4)]


class Seen:
    def __init__(self) -> None:
        self.blocks_seen: list[tuple[int, int, int, int]] = []
        self.preemptions = 0
        self.device_s = 0.0

    def queued(self, waiting: int, running: int) -> None: pass

    def first_token(self, seconds: float, prompt_tokens: int) -> None: pass

    def token_interval(self, seconds: float) -> None: pass

    def step(self, rows: int, bucket: int, seconds: float, context_tokens: int) -> None: pass

    def finished(self, reason: str, generated: int) -> None: pass

    def blocks(self, used: int, free: int, hits: int, misses: int) -> None:
        self.blocks_seen.append((used, free, hits, misses))

    def preempted(self) -> None:
        self.preemptions += 1

    def device_busy(self, seconds: float) -> None:
        self.device_s += seconds


def serve(jobs: list[tuple[list[int], int]], num_blocks: int = 64, block_size: int = 4, chunk: int | None = None,
          prefix: bool = True, rows: int = 8, engine_type: type[PagedStandIn] = PagedStandIn
          ) -> tuple[list[Any], PagedStandIn, Seen]:
    engine = engine_type(num_blocks, block_size, rows=rows)
    seen = Seen()
    s = Scheduler(engine, max_queue=1000, buckets=[1, 2, 4, 8][:rows.bit_length()], observer=seen,
                  pool=BlockPool(num_blocks, block_size, prefix), chunk_tokens=chunk)
    sinks = [s.submit(req(p, n)[0]).on_event for p, n in jobs]
    run_until_idle(s, 10_000)
    return sinks, engine, seen


JOBS = [([5], 12), ([1, 2, 3] * 7, 3), ([9] * 40, 20), ([4, 4], 1), (list(range(30)), 30), ([7] * 17, 9)]


@pytest.mark.parametrize("chunk", [None, 1, 5, 16])
@pytest.mark.parametrize("prefix", [True, False])
@pytest.mark.parametrize("engine_type", [PagedStandIn, MixedStandIn, LaunchStandIn])
def test_tokens_are_each_prompts_own_with_chunking_and_prefix_caching(chunk: int | None, prefix: bool,
                                                                      engine_type: type[PagedStandIn]) -> None:
    sinks, engine, seen = serve(JOBS, chunk=chunk, prefix=prefix, engine_type=engine_type)
    for (p, n), sink in zip(JOBS, sinks):
        assert sink.tokens == alone(p, n) and sink.finish == "length"
    if engine_type is not PagedStandIn:
        assert engine.mixed > 0  # type: ignore[attr-defined]
    if engine_type is LaunchStandIn:
        assert engine.ahead > 0 and not engine.unread  # type: ignore[attr-defined]
        # every launched step's device time reached the observer once
        assert seen.device_s == pytest.approx(engine.launches * STEP_DEVICE_S)  # type: ignore[attr-defined]
    else:
        assert seen.device_s == 0.0


def test_a_mixed_step_that_fails_goes_again_as_two_calls() -> None:
    class Failing(MixedStandIn):
        def step_paged(self, decode: tuple[Any, ...], chunks: tuple[Any, ...]) -> Any:
            raise RuntimeError("mixed refused")

    engine = Failing(64, 4)
    s = Scheduler(engine, max_queue=10, buckets=[1, 2, 4, 8], pool=BlockPool(64, 4), chunk_tokens=4)
    (a, a_sink), (b, b_sink) = req([1, 2, 3], 6), req(list(range(10)), 4)
    s.submit(a)
    s.step()
    s.submit(b)
    run_until_idle(s)
    assert a_sink.tokens == alone([1, 2, 3], 6) and b_sink.tokens == alone(list(range(10)), 4)


def test_a_shared_prefix_is_prefilled_once() -> None:
    """A system prompt of 8 full blocks: once the first request has prefilled it, the others take its blocks
    and prefill only their own two tokens."""
    system = list(range(40, 72))
    jobs = [(system + [i, i + 1], 4) for i in range(5)]
    for prefix in (True, False):
        engine, seen = PagedStandIn(64, 4), Seen()
        s = Scheduler(engine, max_queue=10, buckets=[1, 2, 4, 8], observer=seen, pool=BlockPool(64, 4, prefix))
        sinks = [s.submit(req(*jobs[0])[0]).on_event]
        s.step()
        sinks += [s.submit(req(*job)[0]).on_event for job in jobs[1:]]
        run_until_idle(s)
        for (p, n), sink in zip(jobs, sinks):
            assert sink.tokens == alone(p, n)
        used, free, hits, misses = seen.blocks_seen[-1]
        if prefix:
            assert (hits, misses) == (4 * 8, 8) and engine.prefilled == 34 + 4 * 2
        else:
            assert (hits, misses) == (0, 0) and engine.prefilled == 5 * 34


@pytest.mark.parametrize("calls", ["two", "mixed", "mixed-declined"])
def test_no_running_stream_waits_more_than_one_chunk(calls: str) -> None:
    """A 60-token prompt arrives while a stream decodes: with chunks of 8 the stream gets a token every step.
    With the mixed step each of those steps is one engine call; where the engine declines it (None), two."""
    engine = PagedStandIn(64, 4) if calls == "two" else MixedStandIn(64, 4)
    if isinstance(engine, MixedStandIn):
        engine.declined = calls == "mixed-declined"
    s = Scheduler(engine, max_queue=10, buckets=[1, 2, 4, 8], pool=BlockPool(64, 4), chunk_tokens=8)
    running, sink = req([3, 1, 4], 30)
    s.submit(running)
    s.step()
    long, long_sink = req(list(range(60)), 5)
    s.submit(long)
    run_until_idle(s)
    assert sink.tokens == alone([3, 1, 4], 30) and long_sink.tokens == alone(list(range(60)), 5)
    between = 0  # prefill tokens between two decode steps of the first stream
    for call in engine.log:
        if call[0] == "decode" and running.id in call[1]:
            between = 0
        elif call[0] == "prefill":
            between += call[2]
            assert between <= 8
    assert len([c for c in engine.log if c[0] == "decode" and running.id in c[1]]) == 30 - 1  # one a step
    assert getattr(engine, "mixed", 0) == (8 if calls == "mixed" else 0)  # 60 tokens in chunks of 8
    assert sum(c[2] for c in engine.log if c[0] == "prefill" and c[1] == long.id) == 60
    # only the chunk that ends a prompt asks for its token: the seven before it leave the device running
    assert [c[3] for c in engine.log if c[0] == "prefill" and c[1] == long.id] == [False] * 7 + [True]


def test_block_exhaustion_preempts_and_recomputes_never_an_error() -> None:
    """A pool of 40 blocks of 4 (160 tokens) and six requests growing to 50-90 tokens: rows are preempted
    mid-decode and recomputed later; every request ends with exactly its own tokens."""
    jobs = [([i + 1] * 20, 70 - 5 * i) for i in range(6)]
    for engine_type in (PagedStandIn, MixedStandIn, LaunchStandIn):
        sinks, engine, seen = serve(jobs, num_blocks=40, block_size=4, chunk=16, engine_type=engine_type)
        assert seen.preemptions > 0
        for (p, n), sink in zip(jobs, sinks):
            assert sink.finish == "length" and sink.tokens == alone(p, n)
        assert seen.blocks_seen[-1][0] == 0  # every block given back


def test_admission_waits_for_blocks_and_the_queue_bound_counts_the_rest() -> None:
    engine = PagedStandIn(8, 4)
    s = Scheduler(engine, max_queue=1, buckets=[1, 2, 4, 8], pool=BlockPool(8, 4))
    a = s.submit(req([1] * 13, 3)[0])  # 4 blocks hold its 16 positions
    b = s.submit(req([2] * 13, 3)[0])  # 4 more: the pool is full once both are admitted
    c = s.submit(req([3] * 13, 3)[0])  # no blocks left for it: waits, the one place in the queue
    with pytest.raises(QueueFull):
        s.submit(req([4] * 4, 4)[0])
    s.step()
    assert s.running == 2 and s.waiting == 1
    run_until_idle(s)
    assert all(r.on_event.finish == "length" for r in (a, b, c))  # type: ignore[attr-defined]


def test_a_block_is_offered_to_the_prefix_cache_only_once_its_every_position_is_written() -> None:
    """After a decode step the newest token's KV is not yet written (the next step writes it). A block ending
    with it must not be named yet: a newcomer whose prompt is the stream's text so far, plus more, would take
    that block from the prefix cache and read a slot nothing wrote."""
    engine = PagedStandIn(64, 4)
    s = Scheduler(engine, max_queue=10, buckets=[1, 2, 4, 8], pool=BlockPool(64, 4))
    first, first_sink = req([5, 6], 6)
    s.submit(first)
    s.step()  # prefill positions 0-1, decode position 2: the stream's text is 4 tokens, position 3 unwritten
    text = [5, 6, *first_sink.tokens]
    assert len(text) == 4
    late, late_sink = req(text + [9], 3)
    s.submit(late)
    run_until_idle(s)
    assert late_sink.finish == "length" and late_sink.tokens == alone(text + [9], 3)
    assert first_sink.tokens == alone([5, 6], 6)


def test_a_first_token_is_flushed_as_soon_as_its_prompt_chunk_ends() -> None:
    """With chunked prefill a newcomer's first token goes out (flush) right after the chunk that ends its prompt,
    before the step's decode: the other rows' tokens wait for the step's end."""
    engine = PagedStandIn(64, 4)
    log: list[str] = []
    s = Scheduler(engine, max_queue=10, buckets=[1, 2, 4, 8], pool=BlockPool(64, 4), chunk_tokens=8,
                  flush=lambda: log.append("|"))
    first, _ = req([3, 1, 4], 4)
    first.on_event = lambda ev: log.append("a")
    s.submit(first)
    s.step()
    second, _ = req(list(range(10)), 2)
    second.on_event = lambda ev: log.append("b")
    s.submit(second)
    log.clear()
    s.step()  # the second prompt's first chunk (8 of 10 tokens): no first token yet; the first row decodes
    assert log == ["a"]
    log.clear()
    s.step()  # its last chunk: its first token flushed before the decode step's tokens
    assert log[:2] == ["b", "|"] and set(log[2:]) == {"a", "b"}  # then the decode's tokens (and two ends)


def test_the_chunks_of_a_step_go_to_the_engine_in_one_call() -> None:
    """Five prompts arrive together: with a budget that holds them all, one prefill call carries the five
    chunks (one launch of the paged graph); with a budget of 8 tokens, each step's call carries the chunks that
    fit it, padding included (rows x the longest chunk: the call left-pads its rows). The tokens are each
    prompt's own either way."""
    for chunk, first in ((64, 5), (8, 2)):
        engine = _all_at_once([([i + 1] * (3 + i), 4) for i in range(5)], chunk)
        assert engine.calls[0] == first
        lengths = [c[2] for c in engine.log if c[0] == "prefill"]
        for k in engine.calls:  # each call's rows, in the log's order
            assert k * max(lengths[:k]) <= chunk
            lengths = lengths[k:]


def test_a_long_chunk_does_not_pad_short_prompts_beside_it_past_the_budget() -> None:
    """A 40-token prompt and six 2-token prompts with a budget of 40: the long chunk goes alone (with it, seven
    rows of 40 would be computed); the six short prompts go together in the step after it. Shortest first
    (serve's default), the six go first, the long prompt's first 5 tokens beside them (7 rows of 5)."""
    jobs = [([9] * 40, 2)] + [([i + 1, i + 2], 2) for i in range(6)]
    assert _all_at_once(jobs, 40, order="arrival").calls[:2] == [1, 6]
    engine = _all_at_once(jobs, 40)
    assert engine.calls[:2] == [7, 1] and [c[2] for c in engine.log if c[0] == "prefill"][:7] == [2] * 6 + [5]


def _all_at_once(jobs: list[tuple[list[int], int]], chunk: int, order: str = "shortest") -> PagedStandIn:
    """The jobs submitted together and served to the end with a chunk budget of `chunk`; each gets its own
    tokens. The engine, whose calls and log say how the chunks went."""
    engine = PagedStandIn(64, 4)
    s = Scheduler(engine, max_queue=10, buckets=[1, 2, 4, 8], pool=BlockPool(64, 4), chunk_tokens=chunk,
                  prefill_order=order)
    pairs = [req(p, n) for p, n in jobs]
    for r, _ in pairs:
        s.submit(r)
    run_until_idle(s)
    for (p, n), (_, sink) in zip(jobs, pairs):
        assert sink.tokens == alone(p, n)
    return engine


def test_a_chunk_call_that_fails_is_retried_chunk_by_chunk_so_only_the_bad_request_ends() -> None:
    """The engine refuses any call holding one poisoned request: the step's batched call fails, each chunk is
    then tried alone, and only that request ends in an error; the others get their own tokens."""

    class Refusing(PagedStandIn):
        def prefill_paged(self, keys: list[int], *rest: Any) -> list[int | None]:
            if bad.id in keys:
                raise RuntimeError("refused")
            return super().prefill_paged(keys, *rest)

    engine = Refusing(64, 4)
    s = Scheduler(engine, max_queue=10, buckets=[1, 2, 4, 8], pool=BlockPool(64, 4), chunk_tokens=64)
    (good, good_sink), (bad, bad_sink), (other, other_sink) = req([1, 2, 3], 5), req([4, 5], 5), req([6], 5)
    for r in (good, bad, other):
        s.submit(r)
    run_until_idle(s)
    assert good_sink.tokens == alone([1, 2, 3], 5) and other_sink.tokens == alone([6], 5)
    assert bad_sink.finish == "error" and "refused" in (bad_sink.events[-1].error or "")


def test_a_launched_step_past_a_stop_or_a_cancel_delivers_nothing_more() -> None:
    """With steps launched before the step before is read back, a stream that stops on a token was already in the
    next launched step: that step's token for it is dropped, and its blocks go back. A stream cancelled while its
    step is in flight ends with no token after the cancel. The other streams get their own tokens."""
    engine = LaunchStandIn(64, 4)
    s = Scheduler(engine, max_queue=10, buckets=[1, 2, 4, 8], pool=BlockPool(64, 4), chunk_tokens=8)
    own = alone([3, 1, 4], 20)
    stopper, stop_sink = req([3, 1, 4], 20, stop_ids=frozenset({own[6]}))
    other, other_sink = req([2, 7], 20)
    gone, gone_sink = req([5, 5, 5], 20)
    for r in (stopper, other, gone):
        s.submit(r)
    for _ in range(5):
        s.step()
    assert engine.ahead > 0 and engine.unread  # a step is in flight
    s.cancel(gone)
    seen = len(gone_sink.tokens)
    run_until_idle(s)
    assert stop_sink.tokens == own[:own.index(own[6])] and stop_sink.finish == "stop"
    assert other_sink.tokens == alone([2, 7], 20) and other_sink.finish == "length"
    assert gone_sink.finish == "cancelled" and len(gone_sink.tokens) == seen
    assert s.pool.used == 0  # every block given back


@pytest.mark.parametrize("chunk", [None, 2, 5, 16])
@pytest.mark.parametrize("prefix", [True, False])
def test_chunks_planned_to_captured_graph_shapes_keep_every_prompts_tokens(chunk: int | None, prefix: bool) -> None:
    """With captured chunk graphs, every chunk call fits one of their shapes, within the step's budget (its
    padding counted), and every request still gets exactly its own tokens. A budget below every shape's
    tokens (2) plans as without them."""
    sinks, engine, _ = serve(JOBS, chunk=chunk, prefix=prefix, engine_type=BucketStandIn)
    for (p, n), sink in zip(JOBS, sinks):
        assert sink.tokens == alone(p, n) and sink.finish == "length"
    budget = min(chunk or engine.max_input_len, 16)
    for rows, longest in engine.shapes:
        assert any(r >= rows and t >= longest for r, t in BucketStandIn.chunk_buckets), (rows, longest)
        width = min(t for _, t in BucketStandIn.chunk_buckets if t >= longest)
        assert rows == 1 or rows * width <= budget or budget < 4
    assert engine.mixed > 0
    if budget >= 8:  # room for two rows of 4
        assert any(rows > 1 for rows, _ in engine.shapes)


def test_a_chunk_takes_the_bucket_above_it_where_it_fills_three_quarters_of_it() -> None:
    """The planner's widths under the torch engine's chunk graphs (16 to 512 tokens a row, 512 in all): the first
    prompt's chunk sets the width; later prompts join at half that width or more, while a bucket holds them."""
    from trtbuild.backends.torch.paged_graphs import chunk_buckets as torch_buckets

    class Planned(PagedStandIn):
        chunk_buckets = torch_buckets(1024)

    def plan(*prompt_lens: int) -> list[int]:
        engine = Planned(4096, 16, max_input_len=1024, max_seq_len=2048)
        s = Scheduler(engine, max_queue=10, buckets=[1, 2, 4, 8], pool=BlockPool(4096, 16), chunk_tokens=512)
        for n in prompt_lens:
            r = req([1] * n, 4)[0]
            r.filled = 0
            s._running.append(r)
        return [n for _, n in s._plan_chunks()]

    assert plan(1000) == [512] and plan(400) == [400] and plan(384) == [384]  # 400 fills 3/4 of 512
    assert plan(300) == [256] and plan(44) == [32] and plan(12) == [12]  # 300 would fill 59% of 512
    assert plan(200, 180, 150) == [200, 180]  # width 256: two rows (2 x 256 = 512), a third has no bucket
    assert plan(64, 64, 64, 64, 64, 64, 64, 64, 64) == [64] * 8  # eight questions in the (8, 64) bucket
    assert plan(256, 100) == [256]  # 100 is under half of 256: it waits for a step of its own


def test_the_shortest_prefill_order_takes_the_fewest_tokens_left_first_but_not_past_an_aged_request() -> None:
    """With prefill_order "shortest", a step's chunks go to the prompts with the fewest tokens left (a short
    question is not queued behind a long document); a request admitted AGED_S ago or more keeps its place
    ahead of them. Every prompt's tokens are its own either way."""
    from trtbuild.serving import paged_steps

    def plan(order: str, *prompt_lens: int, old: int | None = None) -> list[int]:
        engine = PagedStandIn(4096, 16, max_input_len=1024, max_seq_len=2048)
        s = Scheduler(engine, max_queue=10, buckets=[1, 2, 4, 8], pool=BlockPool(4096, 16), chunk_tokens=512,
                      prefill_order=order)
        for i, n in enumerate(prompt_lens):
            r = req([1] * n, 4)[0]
            r.filled, r.arrived = 0, time.perf_counter() - (2 * paged_steps.AGED_S if i == old else 0)
            s._running.append(r)
        return [n for _, n in s._plan_chunks()]

    assert plan("arrival", 900, 100, 60) == [512]
    assert plan("shortest", 900, 100, 60) == [60, 100, 170]  # three rows padded to 170: 510 of the 512
    assert plan("shortest", 900, 100, 60, old=0) == [512]  # the 900-token prompt has waited too long
    with pytest.raises(ValueError, match="prefill_order"):
        Scheduler(PagedStandIn(64, 4), pool=BlockPool(64, 4), prefill_order="longest")
    engine = _all_at_once([([9] * 40, 3), ([1, 2], 3), ([5] * 17, 2), ([3], 4)], 8, order="shortest")
    firsts = [c[2] for c in engine.log if c[0] == "prefill"][:2]
    assert firsts == [1, 2]  # the 1- and 2-token prompts first (padded to 2: 4 of the 8 tokens)
