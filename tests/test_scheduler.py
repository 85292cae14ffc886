"""The continuous-batching policy, against a small deterministic stand-in for an engine's slot API.

The stand-in checks what a real engine relies on (a row is prefilled before it is decoded, each row is fed
at the next position of its own sequence, a released row is not decoded) and makes each row's tokens a
function of that row's own history only, so "the tokens it gets alone" is well defined here.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from trtbuild.errors import InputError
from trtbuild.serving.scheduler import Event, QueueFull, Request, Scheduler, ShuttingDown, check_request

VOCAB = 97


class StandIn:
    """Next token = a hash of the row's previous token and its position; records every call."""

    def __init__(self, rows: int = 4, max_input_len: int = 16, max_seq_len: int = 64, fail_prompt: int = -1) -> None:
        self.max_batch_size, self.max_input_len, self.max_seq_len, self.vocab_size = rows, max_input_len, max_seq_len, VOCAB
        self.next_pos: dict[int, int] = {}  # slot -> the position it must be fed next
        self.calls: list[tuple[str, Any]] = []
        self.fail_prompt = fail_prompt

    @staticmethod
    def rule(token: int, position: int) -> int:
        return (token * 31 + position * 7 + 3) % VOCAB

    def prefill(self, slot: int, prompt: list[int], sampling: Any) -> int:
        assert slot not in self.next_pos, f"row {slot} prefilled while in use"
        if prompt[0] == self.fail_prompt:
            raise RuntimeError("device fault")
        self.calls.append(("prefill", slot))
        self.next_pos[slot] = len(prompt)
        return self.rule(sum(prompt), len(prompt) - 1)

    def decode(self, slots: list[int], tokens: list[int], positions: list[int], sampling: list[Any]) -> list[int]:
        assert len(set(slots)) == len(slots) and len(slots) == len(tokens) == len(positions) == len(sampling)
        self.calls.append(("decode", list(slots)))
        out = []
        for s, t, p in zip(slots, tokens, positions):
            assert self.next_pos.get(s) == p, f"row {s} fed at position {p}, expected {self.next_pos.get(s)}"
            assert p < self.max_seq_len
            self.next_pos[s] = p + 1
            out.append(self.rule(t, p))
        return out

    def release(self, slot: int) -> None:
        self.calls.append(("release", slot))
        self.next_pos.pop(slot, None)  # also after a failed prefill


def alone(prompt: list[int], n: int) -> list[int]:
    """The tokens a prompt gets by itself under the stand-in's rule."""
    out = [StandIn.rule(sum(prompt), len(prompt) - 1)]
    for i in range(n - 1):
        out.append(StandIn.rule(out[-1], len(prompt) + i))
    return out


class Collect:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    @property
    def tokens(self) -> list[int]:
        return [e.token for e in self.events if e.token is not None]

    @property
    def finish(self) -> str | None:
        return self.events[-1].finish if self.events else None


class Steps:
    """Records every decode step the observer sees."""

    def __init__(self) -> None:
        self.steps: list[tuple[int, int]] = []
        self.finished: list[str] = []

    def queued(self, waiting: int, running: int) -> None: pass

    def first_token(self, seconds: float, prompt_tokens: int) -> None: pass

    def token_interval(self, seconds: float) -> None: pass

    def step(self, rows: int, bucket: int, seconds: float, context_tokens: int) -> None:
        self.steps.append((rows, bucket))

    def finished(self, reason: str, generated: int) -> None:
        self.finished.append(reason)


def req(prompt: list[int], max_tokens: int, **kw: Any) -> tuple[Request, Collect]:
    sink = Collect()
    return Request(prompt=prompt, max_tokens=max_tokens, on_event=sink, **kw), sink


def run_until_idle(s: Scheduler, limit: int = 1000) -> None:
    for _ in range(limit):
        if not s.step():
            return
    raise AssertionError("the scheduler never went idle")


def test_ragged_rows_each_get_their_own_tokens() -> None:
    engine = StandIn(rows=4)
    s = Scheduler(engine)
    prompts = [[5], [1, 2, 3], [9, 9, 9, 9, 9, 9, 9], [4, 4]]
    lens = [12, 3, 7, 1]
    sinks = []
    for p, n in zip(prompts, lens):
        sinks.append(s.submit(req(p, n)[0]).on_event)
    run_until_idle(s)
    for p, n, sink in zip(prompts, lens, sinks):
        assert sink.tokens == alone(p, n)
        assert sink.finish == "length"
    assert engine.next_pos == {}  # every row released


def test_admission_is_fifo_into_free_rows_at_step_boundaries() -> None:
    engine = StandIn(rows=2)
    s = Scheduler(engine)
    a, b, c, d = (req([i + 1], n)[0] for i, n in enumerate([2, 5, 3, 3]))
    for r in (a, b, c, d):
        s.submit(r)
    s.step()  # a and b admitted, both decoded once: a (2 tokens) is done
    assert engine.calls[:3] == [("prefill", 0), ("prefill", 1), ("decode", [0, 1])]
    assert a.done and not c.done and s.waiting == 2
    assert ("release", 0) in engine.calls
    s.step()  # c takes a's row 0 (the lowest free), is prefilled, then decoded with b
    assert engine.calls[-2:] == [("prefill", 0), ("decode", [1, 0])]
    assert s.waiting == 1 and d.slot is None


def test_smallest_bucket_holding_the_running_rows() -> None:
    engine = StandIn(rows=4)
    obs = Steps()
    s = Scheduler(engine, buckets=[1, 2, 4], observer=obs)
    for n in (2, 3, 4, 6):  # rows finish one after another
        s.submit(req([n], n)[0])
    run_until_idle(s)
    # 4 rows -> bucket 4; as rows end: 3 -> 4, 2 -> 2, 1 -> 1
    assert obs.steps == [(4, 4), (3, 4), (2, 2), (1, 1), (1, 1)]
    assert s.bucket_for(3) == 4 and s.bucket_for(1) == 1


def test_a_finished_row_is_released_at_once_and_reused() -> None:
    engine = StandIn(rows=1)
    s = Scheduler(engine)
    first, sink1 = req([3], 1)  # one token: done right after its prefill
    second, sink2 = req([4], 2)
    s.submit(first)
    s.submit(second)
    s.step()
    assert engine.calls == [("prefill", 0), ("release", 0)]  # no decode for a row that ended at prefill
    s.step()
    assert engine.calls[2:] == [("prefill", 0), ("decode", [0]), ("release", 0)]
    assert sink1.tokens == alone([3], 1) and sink2.tokens == alone([4], 2)


def test_stop_ids_end_a_request_without_delivering_the_stop_token() -> None:
    engine = StandIn()
    s = Scheduler(engine)
    expect = alone([7, 1], 10)
    stop = expect[3]
    r, sink = req([7, 1], 10, stop_ids=frozenset({stop}))
    s.submit(r)
    run_until_idle(s)
    assert sink.tokens == expect[:expect.index(stop)]
    assert sink.finish == "stop" and engine.next_pos == {}


class Letters:
    """A text watch: token t is the letter chr(97 + t % 26); the stop string is 'xy'; holds one letter back."""

    def __init__(self, stop: str) -> None:
        self.text, self.sent, self.stop = "", 0, stop

    def feed(self, token: int) -> tuple[str, bool]:
        self.text += chr(97 + token % 26)
        if (i := self.text.find(self.stop)) >= 0:
            out, self.sent = self.text[self.sent:i], i
            return out, True
        out = self.text[self.sent:-1]
        self.sent = len(self.text) - 1
        return out, False

    def flush(self) -> str:
        return self.text[self.sent:]


def test_stop_string_from_the_text_watch_ends_the_request() -> None:
    expect = "".join(chr(97 + t % 26) for t in alone([2], 20))
    stop = expect[5:7]
    r, sink = req([2], 20, watch=Letters(stop))
    s = Scheduler(StandIn())
    s.submit(r)
    run_until_idle(s)
    assert "".join(e.text for e in sink.events) == expect[:expect.index(stop)]
    assert sink.finish == "stop"
    r2, sink2 = req([2], 4, watch=Letters("zzz"))  # no stop: the held-back letter comes with the end
    s.submit(r2)
    run_until_idle(s)
    assert "".join(e.text for e in sink2.events) == expect[:4] and sink2.finish == "length"


def test_queue_bound() -> None:
    engine = StandIn(rows=1)
    s = Scheduler(engine, max_queue=2)
    s.submit(req([1], 5)[0])  # a free row: admitted at the next step, not counted against the queue
    s.submit(req([2], 5)[0])
    s.submit(req([3], 5)[0])
    with pytest.raises(QueueFull) as exc:
        s.submit(req([4], 5)[0])
    assert exc.value.retry_after_s >= 1
    s.step()  # one admitted, two still waiting for the one row
    with pytest.raises(QueueFull):
        s.submit(req([4], 5)[0])


def test_a_burst_fills_the_idle_rows_and_the_queue_bounds_only_the_rest() -> None:
    """8 idle rows and a queue of 1: of 12 requests at once, 8 are admitted, 1 waits, 3 are refused."""
    engine = StandIn(rows=8)
    s = Scheduler(engine, max_queue=1)
    accepted, refused = [], 0
    for i in range(12):
        try:
            accepted.append(s.submit(req([i + 1], 5)[0]))
        except QueueFull:
            refused += 1
    assert (len(accepted), refused) == (9, 3)
    s.step()
    assert (s.running, s.waiting) == (8, 1)
    run_until_idle(s)
    assert all(r.on_event.finish == "length" for r in accepted)  # type: ignore[attr-defined]


def test_cancel_running_and_waiting() -> None:
    engine = StandIn(rows=1)
    s = Scheduler(engine)
    running, sink_r = req([1], 30)
    waiting, sink_w = req([2], 30)
    s.submit(running)
    s.submit(waiting)
    s.step()
    s.step()
    assert len(sink_r.tokens) == 3
    s.cancel(running)
    s.cancel(waiting)
    assert s.step() is False  # both gone before any device work
    assert sink_r.finish == "cancelled" and len(sink_r.tokens) == 3
    assert sink_w.finish == "cancelled" and sink_w.tokens == []
    assert engine.next_pos == {} and ("release", 0) in engine.calls


def test_engine_failure_ends_that_request_only() -> None:
    engine = StandIn(rows=2, fail_prompt=66)
    s = Scheduler(engine)
    bad, sink_bad = req([66], 4)
    good, sink_good = req([5], 4)
    s.submit(bad)
    s.submit(good)
    run_until_idle(s)
    assert sink_bad.finish == "error" and "device fault" in (sink_bad.events[-1].error or "")
    assert sink_good.tokens == alone([5], 4) and engine.next_pos == {}


def test_a_failing_callback_does_not_stop_the_others() -> None:
    s = Scheduler(StandIn(rows=2))

    def broken(event: Event) -> None:
        raise ValueError("consumer bug")

    s.submit(Request(prompt=[1], max_tokens=5, on_event=broken))
    ok, sink = req([2], 5)
    s.submit(ok)
    run_until_idle(s)
    assert sink.tokens == alone([2], 5) and s.running == 0


def test_requests_that_do_not_fit_name_the_limit() -> None:
    engine = StandIn(max_input_len=8, max_seq_len=12)
    with pytest.raises(InputError, match="max_input_len of 8"):
        check_request(engine, [1] * 9, 1)
    with pytest.raises(InputError, match="max_seq_len of 12 \\(at most 4 new tokens\\)"):
        check_request(engine, [1] * 8, 5)
    with pytest.raises(InputError, match="vocabulary"):
        check_request(engine, [VOCAB], 1)
    with pytest.raises(InputError, match="max_tokens"):
        Scheduler(engine).submit(req([1], 0)[0])


def test_thread_serves_many_requests_and_drains_on_stop() -> None:
    engine = StandIn(rows=4, max_seq_len=64)
    s = Scheduler(engine, max_queue=64)
    s.start()
    done = threading.Event()
    sinks: list[tuple[list[int], int, Collect]] = []
    left = [32]
    lock = threading.Lock()

    def on_event(sink: Collect) -> Any:
        def call(event: Event) -> None:
            sink(event)
            if event.finish:
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()
        return call

    for i in range(32):
        prompt, n = [i % 7 + 1] * (1 + i % 5), 1 + (i * 5) % 17
        sink = Collect()
        s.submit(Request(prompt=prompt, max_tokens=n, on_event=on_event(sink)))
        sinks.append((prompt, n, sink))
    s.stop(drain=True, timeout=30)  # drains: every queued request still completes
    assert done.is_set()
    for prompt, n, sink in sinks:
        assert sink.tokens == alone(prompt, n) and sink.finish == "length"
    with pytest.raises(ShuttingDown):
        s.submit(req([1], 1)[0])


def test_events_are_flushed_after_every_step_and_at_once_after_a_first_token() -> None:
    """A server hands events over in batches (flush): after every step of the thread, and right after each
    newcomer's first token, which must not wait for the other newcomers' prefills and the decode step."""
    engine = StandIn(rows=4, max_seq_len=64)
    log: list[str] = []
    s = Scheduler(engine, max_queue=8, flush=lambda: log.append("|"))
    sinks = [Collect() for _ in range(2)]
    for i, sink in enumerate(sinks):
        s.submit(Request(prompt=[3, 1 + i], max_tokens=3, on_event=lambda ev, i=i, sink=sink: (sink(ev), log.append(f"{i}"))))
    s.start()
    s.stop(drain=True, timeout=30)
    for i, sink in enumerate(sinks):
        assert sink.tokens == alone([3, 1 + i], 3) and sink.finish == "length"
    # step 1: each prefill's token flushed alone, then both rows' decode tokens; step 2: the last tokens and ends
    assert "".join(log) == "0|1|01|0011|"


def test_the_outbox_wakes_the_event_loop_once_a_step_and_keeps_the_order() -> None:
    """Events put during a step reach their queues only at flush, in order, with one call into each loop."""
    import asyncio

    from trtbuild.serving.server import Outbox

    loop = asyncio.new_event_loop()
    calls: list[int] = []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda fn, *a: (calls.append(1), real(fn, *a))[1]  # type: ignore[method-assign]
    a: asyncio.Queue[int] = asyncio.Queue()
    b: asyncio.Queue[int] = asyncio.Queue()
    box = Outbox()
    for i in range(5):
        box.put(loop, a if i % 2 else b, i)
    loop.run_until_complete(asyncio.sleep(0))
    assert a.qsize() == b.qsize() == 0 and calls == []
    box.flush()
    box.flush()  # nothing left: no second wake-up
    loop.run_until_complete(asyncio.sleep(0))
    assert calls == [1]
    assert [a.get_nowait() for _ in range(2)] == [1, 3] and [b.get_nowait() for _ in range(3)] == [0, 2, 4]
    loop.close()
    box.put(loop, a, 9)
    box.flush()  # a closed loop (a server exiting): dropped, not raised
