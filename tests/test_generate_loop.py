"""generate.stream's bookkeeping over a scripted engine (no model): admission into free rows, stop tokens,
budgets, the engine's length limit, slots given back, prompts refused by the limit they exceed."""

from __future__ import annotations

from typing import Any

import pytest

from trtbuild.errors import InputError
from trtbuild.serving.generate import Chunk, Job, collect, stream


class Scripted:
    """Two rows; a prompt's first token is 10 * its first id, and each step adds one."""

    max_batch_size, max_input_len, max_seq_len, vocab_size = 2, 8, 12, 100

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.busy: set[int] = set()

    def prefill(self, slot: int, prompt: list[int], sampling: Any) -> int:
        assert slot not in self.busy
        self.busy.add(slot)
        self.calls.append(("prefill", slot, len(prompt)))
        return 10 * prompt[0]

    def decode(self, slots: list[int], tokens: list[int], positions: list[int], sampling: list[Any]) -> list[int]:
        assert set(slots) <= self.busy
        self.calls.append(("decode", tuple(slots), tuple(positions)))
        return [t + 1 for t in tokens]

    def release(self, slot: int) -> None:
        self.busy.remove(slot)
        self.calls.append(("release", slot))


def test_rows_free_on_a_stop_token_and_the_next_prompt_takes_the_lowest_row() -> None:
    engine = Scripted()
    jobs = [Job([1, 1], max_tokens=5, stop_ids=frozenset({12})), Job([2], max_tokens=5), Job([3, 3, 3], max_tokens=2)]
    done = collect(stream(engine, jobs), 3, with_text=False)
    assert [c.token_ids for c in done] == [[10, 11], [20, 21, 22, 23, 24], [30, 31]]  # 12 stops the first, unreturned
    assert [c.finish_reason for c in done] == ["stop", "length", "length"]
    assert engine.calls[:4] == [("prefill", 0, 2), ("prefill", 1, 1), ("decode", (0, 1), (2, 1)),
                                ("decode", (0, 1), (3, 2))]
    # row 0 ended on its stop token: released, then the third prompt prefilled into it before the next step,
    # which runs both rows, each at its own position
    assert engine.calls[4:7] == [("release", 0), ("prefill", 0, 3), ("decode", (0, 1), (3, 3))]
    assert engine.busy == set()


def test_a_row_ends_at_the_engines_length_and_a_stopped_iteration_gives_its_rows_back() -> None:
    engine = Scripted()
    done = collect(stream(engine, [Job([1] * 8)]), 1, with_text=False)  # positions 8..11 fit max_seq_len 12
    assert len(done[0].token_ids) == 4 and done[0].finish_reason == "length"
    chunks = stream(engine, [Job([1]), Job([2])])
    first: Chunk = next(chunks)
    assert first.token == 10 and engine.busy == {0}
    chunks.close()  # a client gone: every row it held is released
    assert engine.busy == set()


@pytest.mark.parametrize(("job", "message"), [
    (Job([1] * 9), "9 tokens, more than the engine's max_input_len 8"),
    (Job([]), "prompt 0: empty"),
    (Job([1] * 4, max_tokens=9), "exceed the engine's max_seq_len 12"),
    (Job([1], max_tokens=0), "max_tokens: must be >= 1")])
def test_prompts_past_the_engines_shapes_are_refused_naming_the_limit(job: Job, message: str) -> None:
    engine = Scripted()
    with pytest.raises(InputError, match=message):
        list(stream(engine, [job]))
    assert engine.calls == []
