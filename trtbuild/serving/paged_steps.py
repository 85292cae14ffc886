"""How a scheduler step runs over a paged KV pool (serving/kv_blocks.py): admission by blocks, prompts prefilled
in chunks beside the decode rows, both in one call where the engine has the mixed step, steps launched before the
step before is read back, and preemption when blocks run out. Mixed into serving/scheduler.Scheduler, whose
queue, rows, observer and delivery it uses; docs/serve.md says what each does for a user."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trtbuild.serving.request import Request

log = logging.getLogger("trtbuild.serving.scheduler")

AGED_S = 1.0  # with the shortest-first prefill order, a request this old is prefilled in admission order


@dataclass(eq=False)
class _Launch:
    """A paged step launched on the device and not yet read back (PagedSteps._launch)."""

    handle: Any  # the engine's launched step: .result() -> (decode rows' tokens, chunks' tokens or None)
    serial: int
    rows: list[Request]
    plan: list[tuple[Request, int]]
    lasts: list[bool]
    t: float
    context: int  # the decode rows' context tokens, for the observer


class PagedSteps:
    """The paged half of the scheduler's step (Scheduler.step calls `_admit_paged`, then `_paged_step`)."""

    engine: Any  # a scheduler.PagedEngine
    pool: Any  # kv_blocks.BlockPool
    observer: Any
    rows: int
    chunk_tokens: int
    chunk_buckets: list[tuple[int, int]]
    chunk_budget: int
    chunk_widths: list[int]
    prefill_order: str  # "arrival" or "shortest" (`_prefilling`)
    mixed: bool
    overlap: bool
    step_s: float
    flush: Callable[[], None]
    _waiting: deque[Request]
    _running: list[Request]
    _wake: threading.Condition
    _inflight: _Launch | None
    _serial: int

    def bucket_for(self, rows: int) -> int:
        raise NotImplementedError

    def _accept(self, r: Request, token: int) -> None:
        raise NotImplementedError

    def _finish(self, r: Request, reason: str, error: str | None = None, flushed: bool = False) -> None:
        raise NotImplementedError

    def _admit_paged(self) -> list[Request]:
        """Waiting requests, in order, while a row and the pool's blocks allow (the lock is held). The head
        waits for blocks rather than being overtaken, so a long prompt is never starved by short ones."""
        out: list[Request] = []
        while self._waiting and len(self._running) + len(out) < self.rows:
            r = self._waiting[0]
            table = self.pool.admit(r.sequence())
            if table is None:
                break
            self._waiting.popleft()
            r.table, r.filled = table, table.cached
            out.append(r)
        return out

    def _paged_step(self, newcomers: list[Request]) -> bool:
        self._running.extend(newcomers)
        worked = bool(newcomers or self._running)
        if not (self.overlap and self._launch()):
            self._drain()  # the steps below wait for their own tokens: the launched one is read back first
            self._step_in_turn()
        p = self.pool
        self.observer.blocks(p.used, p.free, p.hits, p.misses)
        self.observer.queued(len(self._waiting), len(self._running))
        return worked

    def _step_in_turn(self) -> None:
        """A step whose calls return their tokens: the chunks and the decode rows in one call (the mixed step)
        or two."""
        plan = self._plan_chunks()
        mixed = False
        if plan and self.mixed:
            # the rows decoding now and this step's chunks in one call: the step reads each weight once (a prompt
            # that ends in it decodes from the next step)
            rows = self._make_room(self._due())
            plan = [(r, n) for r, n in plan if r.table is not None]  # not preempted for the rows' blocks
            mixed = bool(rows and plan) and self._mixed(plan, rows)
        if not mixed:  # the chunks, then every row (a prompt that ends in them too)
            if plan:
                self._prefill_chunks(plan)
            rows = self._make_room(self._due())
            if rows:
                self._decode_paged(rows)

    def _due(self) -> list[Request]:
        """The running requests whose next token a decode step gives: its token to feed is known or launched,
        and every position before it is written."""
        return [r for r in self._running if (r.history or r.pending is not None) and r.filled >= r.position]

    def _launch(self) -> bool:
        """Launch this step's decode rows (and its chunks, in the mixed step) without waiting for their tokens,
        then read back and deliver the step launched before, while the device runs this one. A row's token from
        that step is fed to this one on the device. So a row that ends on that token (a stop token or string)
        has computed one token more, which is dropped; a row whose budget that token ends is not launched.
        False, with nothing launched, where this step must wait for its tokens instead: no decode row, chunks
        without the mixed step, a sampled row (its penalties need its tokens on the host), too few free blocks
        for every row's next one (a preemption), or an engine call that declines or fails."""
        plan = self._plan_chunks()
        rows = [r for r in self._due() if r.generated + (r.pending is not None) < r.max_tokens]
        if not rows or (plan and not self.mixed) or self.pool.free < len(rows):
            return False
        if not all(r.sampling is None or r.sampling.greedy for r in [*rows, *(r for r, _ in plan)]):
            return False
        rows = self._make_room(rows)  # a block a row at most, and as many free: nothing is preempted
        serial = self._serial + 1
        fed = [(i, r.pending[1]) for i, r in enumerate(rows) if r.pending is not None]
        args = self._chunk_args(plan) if plan else None
        t = time.perf_counter()
        try:
            handle = self.engine.launch_paged(self._decode_args(rows), args, fed)  # type: ignore[attr-defined]
        except Exception:
            log.exception("launching a step failed; it goes again, waited for")
            return False
        if handle is None:
            return False
        self._serial = serial
        lasts = args[-1] if args else []
        launch = _Launch(handle, serial, rows, plan, lasts, t, sum(r.position + 1 for r in rows))
        for i, r in enumerate(rows):
            r.position += 1
            r.filled, r.pending = r.position, (serial, i)
        for j, ((r, n), last) in enumerate(zip(plan, lasts)):
            self._written(r, n)
            if last:
                r.position, r.pending = len(r.prompt), (serial, len(rows) + j)
        before, self._inflight = self._inflight, launch
        if before is not None:
            self._resolve(before)
        return True

    def _drain(self) -> None:
        """Read back and deliver the launched step, if one is."""
        if self._inflight is not None:
            done, self._inflight = self._inflight, None
            self._resolve(done)

    def _resolve(self, done: _Launch) -> None:
        """Deliver a launched step's tokens (waiting for them): the first tokens of the prompts it ended, then
        the decode rows'. A request that ended since it was launched (a cancel, or a stop on the step before's
        token) has its token dropped."""
        try:
            decoded, firsts = done.handle.result()
        except Exception as exc:
            for r in [*done.rows, *(r for r, _ in done.plan)]:
                r.pending = None
                self._finish(r, "error", f"decode failed: {type(exc).__name__}: {exc}")
            return
        for r in [*(r for r, _ in done.plan), *done.rows]:
            if r.pending is not None and r.pending[0] == done.serial:  # not in the step launched since
                r.pending = None
        if done.handle.device_seconds is not None:
            self.observer.device_busy(done.handle.device_seconds)
        now = time.perf_counter()
        for (r, _), last, token in zip(done.plan, done.lasts, firsts):
            if last and not r.done:
                self._first_token(r, token, now)  # type: ignore[arg-type]
        self._deliver_step(done.rows, decoded, done.t, done.context)

    def _plan_chunks(self) -> list[tuple[Request, int]]:
        """This step's prompt chunks, (request, tokens), in admission order. A step's chunks go in one call as rows
        left-padded to the longest, so the budget counts what the call computes, padding included: k rows of at
        most `chunk_tokens / k` tokens each, and a row is not added where the rows before it are already longer
        than that. Eight 64-token questions after a cached prefix still go together in a 512-token budget;
        a 500-token chunk and six 2-token prompts no longer make a call of 7 x 500 tokens. Where the engine
        replays captured chunk graphs, the chunks are planned to their shapes (`_plan_bucketed`)."""
        if self.chunk_widths:
            return self._plan_bucketed()
        budget, longest = self.chunk_tokens, 0
        plan: list[tuple[Request, int]] = []
        for r, rest in self._prefilling():
            k = len(plan) + 1
            n = min(rest, budget // k)
            if n <= 0 or k * max(longest, n) > budget:
                break
            plan.append((r, n))
            longest = max(longest, n)
        return plan

    def _prefilling(self) -> list[tuple[Request, int]]:
        """The running requests with prompt tokens left to prefill, (request, tokens left), in the order their
        chunks are planned: admission order, or with `prefill_order` "shortest" the fewest tokens left first
        (a request admitted `AGED_S` ago or more keeps its place ahead of the others, so that a long prompt
        is not passed over forever)."""
        out = [(r, r.sequence_len() - r.filled) for r in self._running]
        out = [(r, rest) for r, rest in out if rest > 0]
        if self.prefill_order == "shortest" and len(out) > 1:
            aged = time.perf_counter() - AGED_S
            out.sort(key=lambda item: (item[0].arrived > aged, item[1] if item[0].arrived > aged else 0))
        return out

    def _plan_bucketed(self) -> list[tuple[Request, int]]:
        """This step's chunks planned to a captured chunk graph's (rows, tokens) shape, whose padding is computed
        too: the first prompt's chunk sets the width, the bucket just above it where it fills three quarters of it,
        else the widest one below it (the rest of the prompt goes next step, in chunks that fit better); each
        later prompt joins with a chunk of at most that width, and at least half of it, while a bucket of one row
        more holds the call, within `chunk_budget`."""
        budget, widths = self.chunk_budget, self.chunk_widths
        plan: list[tuple[Request, int]] = []
        width = 0
        for r, rest in self._prefilling():
            if not plan:
                want = min(rest, budget)
                above = next((w for w in widths if w >= want), widths[-1])
                below = [w for w in widths if w <= want]
                width = above if 4 * want >= 3 * above or not below else below[-1]
                plan.append((r, min(want, width)))
                continue
            n = min(rest, width)
            if 2 * n < width or (len(plan) + 1) * width > budget or not any(
                    k > len(plan) and t >= width for k, t in self.chunk_buckets):
                break
            plan.append((r, n))
        return plan

    def _prefill_chunks(self, plan: list[tuple[Request, int]]) -> None:
        """Prefill each planned chunk (the next `n` tokens of r's sequence), all in one engine call: one launch
        of the paged graph however many requests start this step. Where that call fails, each chunk is tried
        alone, so that a bad request ends by itself."""
        args = self._chunk_args(plan)
        try:
            tokens = self.engine.prefill_paged(*args)  # type: ignore[attr-defined]
        except Exception as exc:
            if len(plan) > 1:
                for item in plan:
                    self._prefill_chunks([item])
                return
            self._finish(plan[0][0], "error", f"prefill failed: {type(exc).__name__}: {exc}")
            return
        self._chunks_done(plan, args[-1], tokens)

    def _chunk_args(self, plan: list[tuple[Request, int]]) -> tuple[Any, ...]:
        """`prefill_paged`'s arguments for the planned chunks: keys, tables, chunks, starts, samplings, lasts."""
        seqs = [r.sequence() for r, _ in plan]
        # a chunk's token is wanted only where it ends the prompt: no other makes the host wait for the device
        lasts = [r.filled + n == len(seq) and not r.history for (r, n), seq in zip(plan, seqs)]
        return ([r.id for r, _ in plan], [r.table.blocks for r, _ in plan],
                [seq[r.filled:r.filled + n] for (r, n), seq in zip(plan, seqs)], [r.filled for r, _ in plan],
                [r.sampling for r, _ in plan], lasts)

    def _chunks_done(self, plan: list[tuple[Request, int]], lasts: list[bool], tokens: list[int | None]) -> None:
        for (r, n), last, token in zip(plan, lasts, tokens):
            self._written(r, n)
            if last:  # the prompt's last chunk: the first token, handed over at once
                r.position = len(r.prompt)
                self._first_token(r, token, time.perf_counter())  # type: ignore[arg-type]
        if any(lasts):
            self.flush()
        # after a preemption the recomputed sequence's token was delivered before: the next step feeds last_token

    def _written(self, r: Request, n: int) -> None:
        """A chunk of n more tokens of r's sequence is in its blocks (or queued on the device before any reader):
        the blocks it filled go to the prefix cache."""
        r.filled += n
        self.pool.name_full_blocks(r.table, r.sequence()[:r.filled])

    def _first_token(self, r: Request, token: int, now: float) -> None:
        self.observer.first_token(now - r.arrived, len(r.prompt))
        r.last_time = now
        self._accept(r, token)

    def _make_room(self, rows: list[Request]) -> list[Request]:
        """Blocks for every decode row's next position; where the pool has none, the latest admitted request
        is preempted (its blocks freed, recomputed later) until the rest fit. The rows that still decode."""
        kept: list[Request] = []
        gone: set[int] = set()  # ids of the rows preempted here
        for r in rows:
            if r.id in gone:
                continue
            while not self.pool.grow(r.table, r.position + 1):
                victim = self._running[-1]
                if victim is r and len(self._running) == 1:  # cannot happen with a pool of one full sequence
                    self._finish(r, "error", "the KV pool cannot hold one sequence of the engine's length")
                    gone.add(r.id)
                    break
                self._preempt(victim)
                gone.add(victim.id)
                if victim is r:
                    break
            else:
                kept.append(r)
        return [r for r in kept if r.id not in gone]

    def _preempt(self, r: Request) -> None:
        self._running.remove(r)
        self.pool.release(r.table)
        self.engine.release(r.id)
        r.table, r.filled = None, 0
        with self._wake:
            self._waiting.appendleft(r)
        self.observer.preempted()

    def _mixed(self, plan: list[tuple[Request, int]], rows: list[Request]) -> bool:
        """The decode rows and the planned chunks in one engine call; False, with nothing done, where the engine
        cannot take them together or the call fails (the caller makes the two calls, which end a bad request
        by itself)."""
        t = time.perf_counter()
        args = self._chunk_args(plan)
        try:
            out = self.engine.step_paged(self._decode_args(rows), args)  # type: ignore[attr-defined]
        except Exception:
            log.exception("mixed step failed; its chunks and rows go again in two calls")
            return False
        if out is None:
            return False
        decoded, firsts = out
        self._chunks_done(plan, args[-1], firsts)
        self._decoded(rows, decoded, t)
        return True

    def _decode_args(self, rows: list[Request]) -> tuple[Any, ...]:
        """`decode_paged`'s arguments for the rows: keys, tables, tokens, positions, samplings."""
        return ([r.id for r in rows], [r.table.blocks for r in rows], [r.last_token for r in rows],
                [r.position for r in rows], [r.sampling for r in rows])

    def _decode_paged(self, rows: list[Request]) -> None:
        t = time.perf_counter()
        try:
            tokens = self.engine.decode_paged(*self._decode_args(rows))  # type: ignore[attr-defined]
        except Exception as exc:
            for r in rows:
                self._finish(r, "error", f"decode failed: {type(exc).__name__}: {exc}")
            return
        self._decoded(rows, tokens, t)

    def _decoded(self, rows: list[Request], tokens: list[int], t: float) -> None:
        context = sum(r.position + 1 for r in rows)
        for r in rows:
            r.position += 1
            r.filled = r.position
        self._deliver_step(rows, tokens, t, context)

    def _deliver_step(self, rows: list[Request], tokens: list[int], t: float, context: int) -> None:
        """A decode step's tokens, from a call made at `t`, to its rows (a row ended since then gets none)."""
        now = time.perf_counter()
        self.step_s = 0.9 * self.step_s + 0.1 * (now - t)
        self.observer.step(len(rows), self.bucket_for(len(rows)), now - t, context)
        block = self.pool.block_size
        for r, token in zip(rows, tokens):
            if r.done:
                continue
            self.observer.token_interval(now - r.last_time)
            r.last_time = now
            # the KV through the token fed is written: a block it filled is the only one there is to name
            if (len(r.prompt) + len(r.history)) // block > r.table.named:
                self.pool.name_full_blocks(r.table, r.prompt + r.history)  # the new token not yet among them
            self._accept(r, token)
