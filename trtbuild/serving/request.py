"""A generation request as the scheduler holds it, and the events its caller hears."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


class TextWatch(Protocol):
    """Per request: turns tokens into text that is safe to emit (no half characters) and spots stop strings."""

    def feed(self, token: int) -> tuple[str, bool]:
        """The text that became final with this token, and whether a stop string has now appeared (the text
        then ends before it)."""
        ...

    def flush(self) -> str:
        """What was held back, emitted once the request ends by anything but a stop string."""
        ...


@dataclass(frozen=True)
class Event:
    """What a request's callback receives: one generated token (with the text it made final), or the end.

    `finish` is None while the request runs, else "stop" (a stop token or string), "length" (max_tokens),
    "cancelled" or "error" (`error` says what). A stop token itself is never delivered (`token` None)."""

    token: int | None
    text: str = ""
    finish: str | None = None
    error: str | None = None


@dataclass(eq=False)
class Request:
    """One generation: the prompt's token ids, how to sample, when to stop, and where its events go. Compared by
    identity (the scheduler's lists find and remove requests at every step: a field-by-field comparison made
    that the step's largest cost at 256 rows)."""

    prompt: list[int]
    max_tokens: int
    sampling: Any = None  # trtbuild.backends.sampling.Sampling; None means the engine's default (greedy)
    stop_ids: frozenset[int] = frozenset()  # EOS ids and the request's stop token ids
    watch: TextWatch | None = None  # text and stop strings; None: tokens only
    on_event: Callable[[Event], None] = lambda event: None  # called from the engine thread: must not block
    id: int = field(default_factory=itertools.count().__next__)
    # filled in by the scheduler
    arrived: float = 0.0
    generated: int = 0
    slot: int | None = None
    position: int = 0  # the position of the token fed at the next decode step
    last_token: int = 0
    last_time: float = 0.0
    cancelled: bool = False
    done: bool = False
    # paged (kv_blocks.py): the request's blocks, and how many tokens of its sequence their KV holds
    table: Any = None
    filled: int = 0
    history: list[int] = field(default_factory=list)  # the generated tokens delivered, for a recompute
    # (launch serial, row) of the token a launched step computes for it and the host has not read back yet
    pending: tuple[int, int] | None = None

    def sequence(self) -> list[int]:
        """The tokens whose KV the request needs before its next decode step: the prompt, and after a
        preemption everything generated but the last token (which the next step feeds)."""
        return self.prompt + self.history[:-1] if self.history else self.prompt

    def sequence_len(self) -> int:
        """len(sequence()), without building it."""
        return len(self.prompt) + max(0, len(self.history) - 1)
