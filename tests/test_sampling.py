"""trtbuild/backends/sampling.py on fixed logits: what each parameter allows, the draw's distribution, and draws that
depend only on a row's seed and position."""

from __future__ import annotations

import math

import pytest
import torch

from trtbuild.errors import InputError
from trtbuild.backends.sampling import Sampling, row_key, sample, uniform


def _logits(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs]).repeat(rows, 1)


def _draws(logits: torch.Tensor, s: Sampling, n: int) -> list[int]:
    """n draws of one row, one a position (the counter a request's steps advance)."""
    return [int(sample(logits, [s], [pos])[0]) for pos in range(n)]


def test_greedy_forms_take_the_argmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    want = logits.argmax(-1)
    for s in (Sampling(), Sampling(temperature=0.0, seed=3), Sampling(temperature=2.0, top_k=1, seed=3),
              Sampling(temperature=1.0, top_p=1e-9, seed=3)):
        assert torch.equal(sample(logits, [s] * 3, [5, 6, 7]), want)
    assert Sampling().greedy and Sampling(temperature=0.7, top_k=1).greedy and not Sampling(temperature=0.7).greedy
    assert not Sampling(repetition_penalty=1.2).greedy  # a penalty changes the logits the argmax reads


def test_a_draw_depends_on_the_seed_and_position_only() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(1))
    s = Sampling(temperature=1.0, seed=42)
    batch = sample(logits, [s, Sampling(temperature=0.5, seed=7), s, Sampling()], [10, 10, 11, 10])
    assert int(batch[0]) == int(sample(logits[:1], [s], [10])[0])  # alone or beside others
    assert int(batch[2]) == int(sample(logits[2:3], [s], [11])[0])
    assert _draws(logits[:1], s, 40) == _draws(logits[:1], s, 40)
    assert _draws(logits[:1], s, 40) != _draws(logits[:1], Sampling(temperature=1.0, seed=43), 40)
    u = uniform(torch.tensor([row_key(42, 10), row_key(42, 11)]), 1000)
    assert bool(((u > 0) & (u < 1)).all()) and not torch.equal(u[0], u[1])
    assert row_key(42, 10) == row_key(42, 10) != row_key(42, 11)


def test_draws_follow_softmax_and_the_allowed_set() -> None:
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = _logits(probs)
    n = 4000
    free = _draws(logits, Sampling(temperature=1.0, seed=0), n)
    for token, p in enumerate(probs):
        assert abs(free.count(token) / n - p) < 0.03, (token, free.count(token) / n)
    assert set(_draws(logits, Sampling(temperature=1.0, top_k=2, seed=0), 300)) == {0, 1}
    assert set(_draws(logits, Sampling(temperature=1.0, top_p=0.7, seed=0), 300)) == {0, 1}  # 0.5 + 0.3 reach 0.7
    assert set(_draws(logits, Sampling(temperature=1.0, top_p=0.5, seed=0), 50)) == {0}  # the first reaches it
    hot = _draws(logits, Sampling(temperature=4.0, seed=0), n)
    assert hot.count(3) / n > 0.12  # a high temperature flattens: 0.05 -> ~0.16


def test_penalties_move_the_choice_off_tokens_already_seen() -> None:
    logits = torch.tensor([[2.0, 1.9, -1.0, 0.5]])
    rep = Sampling(repetition_penalty=1.5)
    assert int(sample(logits, [rep], [3], seen=[[0]], generated=[[]])[0]) == 1  # 2.0 / 1.5 < 1.9
    assert int(sample(logits, [Sampling(presence_penalty=0.5)], [3], seen=[[0]], generated=[[0]])[0]) == 1
    assert int(sample(logits, [Sampling(presence_penalty=0.5)], [3], seen=[[0]], generated=[[]])[0]) == 0
    assert torch.equal(logits, torch.tensor([[2.0, 1.9, -1.0, 0.5]]))  # the caller's logits untouched


@pytest.mark.parametrize(("field", "value", "message"), [
    ("temperature", -0.1, "temperature: must be >= 0"), ("top_k", -1, "top_k: must be >= 0"),
    ("top_p", 0.0, "top_p: must be in (0, 1]"), ("top_p", 1.5, "top_p: must be in (0, 1]"),
    ("repetition_penalty", 0.0, "repetition_penalty: must be > 0"), ("seed", -1, "seed: must be in")])
def test_out_of_range_parameters_are_named(field: str, value: float, message: str) -> None:
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        Sampling(**{field: value}).checked()
