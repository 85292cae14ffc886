"""The model's paged KV cache against its row cache: the same logits for a prompt prefilled whole or in chunks
from any start position, through scattered block tables, with two sequences sharing one pool."""

from __future__ import annotations

import torch

from tests.conftest import random_tiny_model
from trtbuild.models.llama import Transformer
from trtbuild.models.paged import BLOCK, PagedStep, pool_shape


def _rows_reference(model: Transformer, prompt: list[int], n: int) -> list[torch.Tensor]:
    """Logits of the prompt's last position and of n - 1 greedy decode steps, through the row cache."""
    out = []
    with torch.no_grad():
        logits = model(torch.tensor([prompt]), torch.arange(len(prompt)), from_start=True)
        out.append(logits[0])
        for i in range(n - 1):
            tok = logits.argmax(-1, keepdim=True)
            logits = model(tok, torch.tensor([[len(prompt) + i]]))
            out.append(logits[0])
    return out


def test_chunked_prefill_and_decode_through_block_tables_match_the_row_cache() -> None:
    model = random_tiny_model(max_batch_size=2)
    cfg = model.cfg
    pools = [torch.zeros(pool_shape(cfg, 12)) for _ in range(2 * cfg.num_layers)]
    step = PagedStep(model)
    prompts = [[(7 * i + 3) % cfg.vocab_size for i in range(37)], [(5 * i + 1) % cfg.vocab_size for i in range(20)]]
    tables = [[9, 2, 6, 0, 11], [4, 10, 1, 7]]  # scattered, interleaved in one pool
    n = 8
    want = [_rows_reference(model, p, n) for p in prompts]
    got: list[list[torch.Tensor]] = [[], []]
    last = []
    with torch.no_grad():
        for r, (prompt, chunks) in enumerate(zip(prompts, ([0, 16, 21, 37], [0, 1, 20]))):
            for a, b in zip(chunks, chunks[1:]):  # chunks that end mid-block and start mid-block
                used = -(-b // BLOCK)
                _, logits = step(torch.tensor([prompt[a:b]]), torch.arange(a, b)[None], torch.tensor([tables[r][:used]]),
                                 *pools)
            got[r].append(logits[0])
            last.append(int(logits[0].argmax()))
        for i in range(n - 1):  # both sequences in one decode batch, each at its own position
            positions = [len(p) + i for p in prompts]
            width = max(-(-(q + 1) // BLOCK) for q in positions)
            blocks = torch.tensor([t[:width] + [t[0]] * (width - len(t[:width])) for t in tables])
            _, logits = step(torch.tensor(last)[:, None], torch.tensor(positions)[:, None], blocks, *pools)
            for r in range(2):
                got[r].append(logits[r])
            last = logits.argmax(-1).tolist()
    for r in range(2):
        for g, w in zip(got[r], want[r]):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_a_mixed_step_decodes_and_prefills_as_the_separate_calls_do() -> None:
    """Decode rows and left-padded chunk rows in one forward (MixedStep): each row's logits equal those of a
    decode call and a chunk call of the paged step, and the pools end up the same."""
    from trtbuild.models.paged import MixedStep

    model = random_tiny_model(max_batch_size=2)
    cfg = model.cfg
    prompts = [[(7 * i + 3) % cfg.vocab_size for i in range(37)], [(5 * i + 1) % cfg.vocab_size for i in range(20)]]
    tables = [[9, 2, 6, 0, 11], [4, 10, 1, 7]]
    newcomers = [[(3 * i + 2) % cfg.vocab_size for i in range(21)], [(11 * i + 5) % cfg.vocab_size for i in range(9)]]
    new_tables = [[5, 3], [8, 12]]  # block 12: the second newcomer's padding goes past its own block
    step, mixed = PagedStep(model), MixedStep(model)
    base = [torch.zeros(pool_shape(cfg, 14)) for _ in range(2 * cfg.num_layers)]
    with torch.no_grad():
        last = []
        for prompt, table in zip(prompts, tables):
            _, logits = step(torch.tensor([prompt]), torch.arange(len(prompt))[None],
                             torch.tensor([table[:-(-len(prompt) // BLOCK)]]), *base)
            last.append(int(logits[0].argmax()))
        positions = [len(p) for p in prompts]
        width = max(-(-(q + 1) // BLOCK) for q in positions)
        dec = (torch.tensor(last)[:, None], torch.tensor(positions)[:, None],
               torch.tensor([t[:width] + [t[0]] * (width - len(t[:width])) for t in tables]))
        # the second newcomer's chunk continues from position 3 (as after a cached prefix or an earlier chunk),
        # left-padded to 21 tokens on the block past its own
        chunk_tokens = [newcomers[0], [0] * 12 + newcomers[1]]
        chunk_pos = [list(range(21)), [16 + i for i in range(12)] + list(range(3, 12))]
        chunk = (torch.tensor(chunk_tokens), torch.tensor(chunk_pos), torch.tensor([new_tables[0], [8, 12]]))
        separate = [p.clone() for p in base]
        _, want_dec = step(*dec, *separate)
        _, want_chunk = step(*chunk, *separate)
        together = [p.clone() for p in base]
        greedy, got = mixed(*dec, *chunk, *together)
    assert got.shape == (4, cfg.vocab_size) and greedy.shape == (4, 1)
    torch.testing.assert_close(got[:2], want_dec, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[2:], want_chunk, rtol=1e-4, atol=1e-4)
    for a, b in zip(separate, together):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
