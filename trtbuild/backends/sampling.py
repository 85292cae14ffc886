"""Choosing the next token from a step's logits, on the logits' device: greedy, temperature, top-k, top-p,
seeded, with repetition and presence penalties.

Greedy is not done here: the compiled graphs return their own argmax beside the logits, and a greedy row
takes that token as it is (bit for bit what the engine always produced). A sampled row draws by the
Gumbel-max trick, argmax(logits / T + g) with g = -log(-log(u)), which picks token i with probability
softmax(logits / T)_i; top-k and top-p set the logits outside their set to -inf first. The uniform draws u
come from a counter-based hash of (seed, position, token id) computed with integer tensor ops, not from a
torch.Generator: a row's draws then depend on nothing but its own seed and position, never on the other
rows of the batch, the batch bucket or the order of the rows, and a replay of the same request gives the
same tokens. (One Generator a row would make a draw per row and per step, and a captured CUDA graph cannot
hold a Generator's state per request.)

A leaf module: torch is imported inside the functions that need it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trtbuild.errors import InputError

_MASK32 = 0xFFFFFFFF
# A multiplier below 2**27: a 32-bit value times it stays below 2**59, so int64 tensor arithmetic never
# overflows and the CPU and CUDA give the same bits (the "lowbias32"-style integer finalizer's constant).
_MIX = 0x45D9F3B


@dataclass(frozen=True)
class Sampling:
    """How one request picks its tokens. The defaults are greedy."""

    temperature: float = 0.0  # 0 = greedy (bit for bit the engine's argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None  # same seed + same prompt -> same tokens, whatever else is in the batch
    repetition_penalty: float = 1.0  # > 1 discourages every token of the prompt and the output (CTRL's form)
    presence_penalty: float = 0.0  # subtracted from the logit of every token already generated (OpenAI's)

    @property
    def greedy(self) -> bool:
        """True when the engine's own argmax is this request's token: no temperature, or a top-k of 1,
        and no penalty that changes the logits."""
        plain = self.repetition_penalty == 1.0 and self.presence_penalty == 0.0
        return plain and (self.temperature == 0.0 or self.top_k == 1)

    def problems(self) -> list[str]:
        """What is out of range, as `field: message` lines (empty when valid)."""
        found = []
        if not self.temperature >= 0.0:
            found.append(f"temperature: must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            found.append(f"top_k: must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            found.append(f"top_p: must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0.0:
            found.append(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            found.append(f"seed: must be in [0, 2**64), got {self.seed}")
        return found

    def checked(self) -> "Sampling":
        """Itself, or InputError naming every field out of range."""
        found = self.problems()
        if found:
            raise InputError("sampling: " + "; ".join(found))
        return self


GREEDY = Sampling()


def _hash32(x: int) -> int:
    """The integer finalizer `_hash32_tensor` applies, on a Python int (for the per-row keys)."""
    x &= _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    return (x >> 16) ^ x


def _hash32_tensor(x: Any) -> Any:
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    x = ((x >> 16) ^ x) * _MIX & _MASK32
    return (x >> 16) ^ x


def row_key(seed: int | None, position: int) -> int:
    """The 32-bit key of one row's draw at one position: a function of the seed and the position only.
    No seed: a fresh key from the process's random source (such a request is not reproducible)."""
    if seed is None:
        return random.getrandbits(32)
    return _hash32(_hash32(seed) ^ _hash32((seed >> 32) + 0x9E3779B9) ^ _hash32(position * 0x632BE5AB + 1))


def uniform(keys: Any, vocab: int) -> Any:
    """(n, vocab) float32 draws in (0, 1), one row a key (an int64 tensor of 32-bit keys): 24 bits of a
    hash of (key, token id), so a row's draws are the same on any device and in any batch."""
    import torch

    ids = _hash32_tensor(torch.arange(vocab, device=keys.device, dtype=torch.int64) * 0x9E3779B1 & _MASK32)
    bits = _hash32_tensor(keys[:, None] ^ ids[None, :]) >> 8
    return (bits.to(torch.float32) + 0.5) * 2.0**-24


def sample(logits: Any, params: Sequence[Sampling], positions: Sequence[int],
           seen: Sequence[Sequence[int]] | None = None, generated: Sequence[Sequence[int]] | None = None) -> Any:
    """The next token of each row of `logits` (n, V), by its `params` at its `positions` (the position of the
    token fed to the step that made these logits: the draw's counter). `seen` (prompt and output tokens,
    for the repetition penalty) and `generated` (output tokens, for the presence penalty) are needed only
    where a row has that penalty. Returns an int64 tensor (n,) on the logits' device. Greedy rows get the
    argmax here; callers that have the graph's own argmax use it instead (`Sampling.greedy`)."""
    import torch

    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    pres = [i for i, p in enumerate(params) if p.presence_penalty != 0.0]
    # a copy where the penalties write into it: the logits may be a graph's output buffer
    x = logits.to(torch.float32, copy=bool(rep or pres))
    n, vocab = x.shape
    dev = x.device
    if rep:
        if seen is None:
            raise ValueError("sample: a repetition penalty needs the tokens seen")
        _repetition(x, rep, [params[i].repetition_penalty for i in rep], [seen[i] for i in rep])
    if pres:
        if generated is None:
            raise ValueError("sample: a presence penalty needs the tokens generated")
        for i in pres:
            ids = torch.tensor(sorted(set(generated[i])), dtype=torch.long, device=dev)
            if ids.numel():
                x[i].index_add_(0, ids, torch.full((ids.numel(),), -params[i].presence_penalty, device=dev))
    out = x.argmax(-1)
    drawn = [i for i, p in enumerate(params) if p.temperature > 0.0 and p.top_k != 1]
    if not drawn:
        return out
    ks = [min(params[i].top_k, vocab) for i in drawn]
    k_max = max(ks)
    # Every per-row number in one host-to-device copy (small copies from pageable memory each wait for the
    # device): the row, its temperature, its top-k index, whether top-k is off, its top-p, its draw's key.
    # float64 holds each exactly, the 32-bit keys included.
    table = torch.tensor([[i, params[i].temperature, (k or k_max or 1) - 1, k == 0, params[i].top_p,
                           row_key(params[i].seed, positions[i])] for i, k in zip(drawn, ks)],
                         dtype=torch.float64).to(dev)
    rows = table[:, 0].long()
    y = x.index_select(0, rows) / table[:, 1].float()[:, None]
    if k_max:
        kth = y.topk(k_max, dim=-1).values  # (m, k_max), descending
        cut = kth.gather(-1, table[:, 2].long()[:, None])
        y = y.masked_fill((y < cut) & ~table[:, 3].bool()[:, None], float("-inf"))
    if any(params[i].top_p < 1.0 for i in drawn):
        y = _top_p(y, table[:, 4].float())
    keys = table[:, 5].long()
    gumbel = -torch.log(-torch.log(uniform(keys, vocab)))
    out[rows] = (y + gumbel).argmax(-1)
    return out


def _repetition(x: Any, rows: list[int], penalties: list[float], seen: list[Sequence[int]]) -> None:
    """CTRL's repetition penalty, in place, as transformers applies it: a seen token's positive logit is
    divided by the penalty, a negative one multiplied."""
    import torch

    for row, penalty, ids in zip(rows, penalties, seen):
        idx = torch.tensor(sorted(set(ids)), dtype=torch.long, device=x.device)
        if idx.numel() == 0:
            continue
        v = x[row, idx]
        x[row, idx] = torch.where(v > 0, v / penalty, v * penalty)


def _top_p(y: Any, top_p: Any) -> Any:
    """Keep each row's smallest set of most probable tokens whose probability reaches its top_p (the first
    always kept); the rest to -inf."""
    import torch

    ordered, order = y.sort(dim=-1, descending=True)
    mass = ordered.softmax(-1).cumsum(-1)
    drop_sorted = (mass - ordered.softmax(-1)) >= top_p[:, None]  # the mass before a token already reaches p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return y.masked_fill(drop, float("-inf"))
