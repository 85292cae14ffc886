"""A Triton attention kernel for the paged KV cache (models/paged.py): each query reads its sequence's keys and
values through the sequence's block table, never a gathered copy of them.

Why it exists: the paged graph's ATen attention (`llama.paged_attention`) gathers every row's blocks into a
contiguous (B, KV, N * BLOCK, D) copy each step and layer, then multiplies over the whole table width, the
masked slots included: a decode step reads the filled cache twice and writes it once, plus fp32 scores of the
widest row for every row. Here each program streams the slots it attends over once, from the pool.

A decode step (one token a row) is split-KV decoding ("flash-decoding") in two launches, as
kernels/decode_attention.py: the first gives each program one sequence, one KV head with its query heads
stacked (grouped-query attention reads each cached row once) and one slice of the filled slots, and keeps an
online softmax; the second merges the slices. A prompt chunk (several tokens, each at its own position) is a
third kernel: each program takes a tile of the chunk's tokens with their query heads stacked, (token, query
head) pairs as the rows of a 64-row dot, and streams every slot up to the tile's latest position once, each
row masked past its own position, with no slices to merge (a chunk has tiles enough to fill the device). A
chunk through the decode kernels' 16-row tiles re-read the request's cache four times as often and wrote
fp32 partials of 16 slices for every (token, head).

The paged graph's rows and tokens are dynamic (one compiled graph serves every batch), so nothing the launch
fixes at compile time may depend on them: every call launches all three kernels, and those not meant for the
call's token count return at once (the decode kernels' grids have one tile a row, the chunk kernel's one per
tile of the chunk, so the idle launches are small). The grid's slices are constant (SPLITS); each program
works out on the device how many of them its row uses (fewer when rows are many: `_slice_len`) and its slice
of the filled slots from the positions (a short sequence's later slices are empty and return at once). Registered as a custom op that AOTInductor compiles into the paged graph.
Imported only where Triton is present; on the CPU the model keeps its ATen attention.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

BLOCK_S = 32  # cache slots per loop step: two blocks of 16, a (16 x D) by (D x 32) dot
BLOCK_R = 16  # rows of a decode tile, (token, query head) pairs: the smallest tensor-core dot
SPLITS = 16  # the most slices of the filled slots a (row, KV head): a 4096-token row in slices of 256
PROGRAMS = 1024  # decode programs with work a step aims for: several a streaming multiprocessor
CHUNK_R = 64  # rows of a prompt chunk's tile: 16 tokens of four query heads a KV head
CHUNK_S = 64  # cache slots per loop step of a chunk's tile


def source_digest() -> str:
    """This file's content: a compiled graph that calls the kernel is only reusable with the same kernel."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def supports(cfg: Any, dtype: torch.dtype) -> str | None:
    """None when the kernel can serve this model's paged attention, else why not."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype} (the kernel's tensor-core dots would round fp32 to tf32)"
    d, heads, kv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    if d < 16 or d & (d - 1):
        return f"head_dim {d} (the kernel takes a power of two >= 16)"
    if heads % kv or heads // kv > BLOCK_R:
        return f"{heads} query heads over {kv} KV heads (the kernel stacks at most {BLOCK_R} per KV head)"
    if cfg.layer_windows or cfg.attn_softcap:
        return "sliding windows or soft-capped scores (the kernel masks by position only)"
    return None


def tokens_per_tile(rep: int) -> int:
    """Tokens whose query heads fill one tile's rows."""
    return max(1, BLOCK_R // rep)


@triton.jit
def _slice_len(filled, PAIRS, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, PROGRAMS: tl.constexpr):
    """Slots per slice: the filled ones spread over as many slices as give the step about PROGRAMS programs with
    work (PAIRS (sequence, KV head) pairs; 1 to SPLITS slices each), rounded up to whole BLOCK_S steps, so the
    first cdiv(filled, this) slices hold slots and the rest none. Slice 0 always holds slot 0. Many rows need
    no slicing to fill the device, and each slice costs a program's start, its partials and the merge's reads
    (at 256 rows of 512 tokens on an H100, 16 slices a row made the step's attention 2.3 of its 4.2 ms)."""
    slices = tl.minimum(tl.maximum(tl.cdiv(PROGRAMS, PAIRS), 1), SPLITS)
    return tl.cdiv(tl.cdiv(filled, slices), BLOCK_S) * BLOCK_S


@triton.jit
def _tile_filled(pos_ptr, b, tile, T, stride_pb, stride_pt, TOK: tl.constexpr, TOK_P2: tl.constexpr):
    """Slots the tile's tokens attend over together: up to the latest position among them, itself included."""
    t = tile * TOK + tl.arange(0, TOK_P2)
    p = tl.load(pos_ptr + b * stride_pb + t * stride_pt, mask=(t < T) & (tl.arange(0, TOK_P2) < TOK), other=0)
    return tl.max(p, 0) + 1


@triton.jit
def _paged_partial(q_ptr, k_ptr, v_ptr, pos_ptr, table_ptr, o_ptr, ml_ptr, T, TILES, KV, PAIRS,
                   stride_qb, stride_qt, stride_qh, stride_pb, stride_pt, stride_tb,
                   stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                   REP: tl.constexpr, TOK: tl.constexpr, TOK_P2: tl.constexpr, BLOCK_R: tl.constexpr,
                   D: tl.constexpr, PAGE: tl.constexpr, BLOCK_S: tl.constexpr, SPLITS: tl.constexpr,
                   SCALE: tl.constexpr, PROGRAMS: tl.constexpr):
    if T > 1:  # a prompt chunk: _paged_chunk's
        return
    g = tl.program_id(0)  # (sequence, tile, KV head)
    split = tl.program_id(1)
    b = g // (TILES * KV)
    tile = (g // KV) % TILES
    kv = g % KV
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, D)
    tok = tile * TOK + r // REP
    valid = (r < TOK * REP) & (tok < T)  # rows past the tile's tokens are padding for the dot
    pos = tl.load(pos_ptr + b * stride_pb + tok * stride_pt, mask=valid, other=-1)
    filled = _tile_filled(pos_ptr, b, tile, T, stride_pb, stride_pt, TOK, TOK_P2)
    per = _slice_len(filled, PAIRS, SPLITS, BLOCK_S, PROGRAMS)
    start = split * per
    end = tl.minimum(start + per, filled)
    if start < end:
        # query head kv * REP + i uses KV head kv (Hugging Face's repeat_kv order)
        q = tl.load(q_ptr + b * stride_qb + tok[:, None] * stride_qt + (kv * REP + r % REP)[:, None] * stride_qh
                    + d[None, :], mask=valid[:, None], other=0.0)
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        for s0 in range(start, end, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            s_mask = s < end
            # slot s is in the sequence's block table[s // PAGE], at offset s % PAGE
            block = tl.load(table_ptr + b * stride_tb + s // PAGE, mask=s_mask, other=0)
            k = tl.load(k_ptr + block[:, None] * stride_kb + kv * stride_kh + (s % PAGE)[:, None] * stride_ks
                        + d[None, :], mask=s_mask[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k)) * SCALE
            # each row sees the slots up to its own position (a prompt chunk's tokens differ)
            scores = tl.where(s_mask[None, :] & (s[None, :] <= pos[:, None]), scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            # a row with no visible slot yet (its position before this slice) keeps m = -inf, weight 0
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_ref)
            p = tl.exp(scores - m_ref[:, None])
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + block[:, None] * stride_vb + kv * stride_vh + (s % PAGE)[:, None] * stride_vs
                        + d[None, :], mask=s_mask[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        # unnormalized partials, only of slices that hold slots: the merge reads no others
        row = (g * SPLITS + split) * BLOCK_R + r
        tl.store(o_ptr + row[:, None] * D + d[None, :], acc, mask=valid[:, None])
        tl.store(ml_ptr + row * 2, m, mask=valid)
        tl.store(ml_ptr + row * 2 + 1, total, mask=valid)


@triton.jit
def _paged_merge(o_ptr, ml_ptr, y_ptr, pos_ptr, T, TILES, KV, PAIRS, stride_pb, stride_pt, stride_yb, stride_yt, stride_yh,
                 REP: tl.constexpr, TOK: tl.constexpr, TOK_P2: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr,
                 BLOCK_S: tl.constexpr, SPLITS: tl.constexpr, PROGRAMS: tl.constexpr):
    """One query row's output, (sequence, token, query head), from the partials of its tile's slices."""
    if T > 1:  # a prompt chunk: _paged_chunk's
        return
    pid = tl.program_id(0)
    h = pid % (KV * REP)
    t = (pid // (KV * REP)) % T
    b = pid // (KV * REP * T)
    tile = t // TOK
    filled = _tile_filled(pos_ptr, b, tile, T, stride_pb, stride_pt, TOK, TOK_P2)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    # slice 0 holds slot 0, which every row sees: the maximum below is finite
    held = sp < tl.cdiv(filled, _slice_len(filled, PAIRS, SPLITS, BLOCK_S, PROGRAMS))
    g = (b * TILES + tile) * KV + h // REP
    row = (g * SPLITS + sp) * BLOCK_R + (t % TOK) * REP + h % REP
    m = tl.load(ml_ptr + row * 2, mask=held, other=float("-inf"))
    total = tl.load(ml_ptr + row * 2 + 1, mask=held, other=0.0)
    weight = tl.exp(m - tl.max(m, 0))  # a slice past this row's position has m = -inf: weight 0
    o = tl.load(o_ptr + row[:, None] * D + d[None, :], mask=held[:, None], other=0.0)
    y = tl.sum(o * weight[:, None], 0) / tl.sum(total * weight, 0)
    tl.store(y_ptr + b * stride_yb + t * stride_yt + h * stride_yh + d, y.to(y_ptr.dtype.element_ty))


@triton.jit
def _paged_chunk(q_ptr, k_ptr, v_ptr, pos_ptr, table_ptr, y_ptr, T, TILES, KV,
                 stride_qb, stride_qt, stride_qh, stride_pb, stride_pt, stride_tb,
                 stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_yb, stride_yt, stride_yh,
                 REP: tl.constexpr, TOK: tl.constexpr, TOK_P2: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr,
                 PAGE: tl.constexpr, BLOCK_S: tl.constexpr, SCALE: tl.constexpr):
    """A prompt chunk's tile of TOK tokens and one KV head, its query heads stacked: every slot up to the tile's
    latest position once, each row masked past its own; the normalized output written."""
    if T == 1:  # a decode step: the partial and merge kernels'
        return
    g = tl.program_id(0)  # (sequence, tile, KV head)
    b = g // (TILES * KV)
    tile = (g // KV) % TILES
    kv = g % KV
    r = tl.arange(0, ROWS)
    d = tl.arange(0, D)
    tok = tile * TOK + r // REP
    valid = (r < TOK * REP) & (tok < T)
    pos = tl.load(pos_ptr + b * stride_pb + tok * stride_pt, mask=valid, other=-1)
    filled = _tile_filled(pos_ptr, b, tile, T, stride_pb, stride_pt, TOK, TOK_P2)
    head = kv * REP + r % REP  # Hugging Face's repeat_kv order, as the decode kernels
    q = tl.load(q_ptr + b * stride_qb + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=valid[:, None], other=0.0)
    m = tl.full([ROWS], float("-inf"), tl.float32)
    total = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    for s0 in range(0, filled, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_mask = s < filled
        block = tl.load(table_ptr + b * stride_tb + s // PAGE, mask=s_mask, other=0)
        k = tl.load(k_ptr + block[:, None] * stride_kb + kv * stride_kh + (s % PAGE)[:, None] * stride_ks
                    + d[None, :], mask=s_mask[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * SCALE
        scores = tl.where(s_mask[None, :] & (s[None, :] <= pos[:, None]), scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padding row sees no slot: weight 0
        alpha = tl.exp(m - m_ref)
        p = tl.exp(scores - m_ref[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + block[:, None] * stride_vb + kv * stride_vh + (s % PAGE)[:, None] * stride_vs
                    + d[None, :], mask=s_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    y = acc / tl.where(total > 0, total, 1.0)[:, None]
    tl.store(y_ptr + b * stride_yb + tok[:, None] * stride_yt + head[:, None] * stride_yh + d[None, :],
             y.to(y_ptr.dtype.element_ty), mask=valid[:, None])


def _run(partial: Any, merge: Any, chunk: Any, q: Tensor, k_pool: Tensor, v_pool: Tensor, pos: Tensor,
         table: Tensor, scale: float) -> Tensor:
    b, t, heads, d = q.shape
    kv, page = k_pool.shape[1], k_pool.shape[2]
    if (q.stride(-1) != 1 or k_pool.stride(3) != 1 or v_pool.stride(3) != 1 or heads % kv or k_pool.shape[3] != d
            or pos.dim() != 2 or table.dim() != 2):
        raise ValueError(f"paged_attention takes q [B, T, H, D], pools [blocks, KV, BLOCK, D] with contiguous rows, "
                         f"positions [B, T] and block tables [B, N], got {tuple(q.shape)}, {tuple(k_pool.shape)}, "
                         f"{tuple(pos.shape)}, {tuple(table.shape)}")
    rep = heads // kv
    tok = tokens_per_tile(rep)
    # the decode kernels serve one token a row: one tile a row, whatever t is (a chunk's call returns at once)
    o = torch.empty((b * kv, SPLITS, BLOCK_R, d), dtype=torch.float32, device=q.device)
    ml = torch.empty((b * kv, SPLITS, BLOCK_R, 2), dtype=torch.float32, device=q.device)
    y = torch.empty((b, t, heads, d), dtype=q.dtype, device=q.device)
    # TOK_P2 at least 2: a one-element arange (sixteen queries a KV head) is the one width no other kernel here uses
    consts = {"REP": rep, "TOK": tok, "TOK_P2": max(2, triton.next_power_of_2(tok)), "BLOCK_R": BLOCK_R, "D": d,
              "BLOCK_S": BLOCK_S, "SPLITS": SPLITS, "PROGRAMS": PROGRAMS}
    # the scale a compile-time constant: AOTInductor passes a float argument as fp64, which would promote the
    # scores and the running maximum to fp64
    partial[(b * kv, SPLITS)](
        q, k_pool, v_pool, pos, table, o, ml, t, 1, kv, b * kv,
        q.stride(0), q.stride(1), q.stride(2), pos.stride(0), pos.stride(1), table.stride(0),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        PAGE=page, SCALE=scale, num_warps=4, **consts)
    merge[(b * heads,)](
        o, ml, y, pos, t, 1, kv, b * kv, pos.stride(0), pos.stride(1), y.stride(0), y.stride(1), y.stride(2),
        num_warps=1, **consts)
    ctok = max(1, CHUNK_R // rep)
    chunk[(b * ((t + ctok - 1) // ctok) * kv,)](
        q, k_pool, v_pool, pos, table, y, t, (t + ctok - 1) // ctok, kv,
        q.stride(0), q.stride(1), q.stride(2), pos.stride(0), pos.stride(1), table.stride(0),
        k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
        y.stride(0), y.stride(1), y.stride(2), REP=rep, TOK=ctok, TOK_P2=max(2, triton.next_power_of_2(ctok)),
        ROWS=max(16, triton.next_power_of_2(ctok * rep)), D=d, PAGE=page, BLOCK_S=CHUNK_S, SCALE=scale,
        num_warps=4 if d <= 64 else 8)  # a 64 x 128 fp32 accumulator over 128 threads would spill
    return y


def paged_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, pos: Tensor, table: Tensor,
                    scale: float | None = None) -> Tensor:
    """Attention of q [B, T, H, D] (after rope) at positions pos [B, T] over the pools [blocks, KV, BLOCK, D]
    through the block tables [B, N]: query (b, t) reads slots 0..pos[b, t] of sequence b, slot s in block
    table[b, s // BLOCK]. The step's own keys and values must be in the pools already. Returns [B, T, H, D].
    An eager launch."""
    return _run(_paged_partial, _paged_merge, _paged_chunk, q, k_pool, v_pool, pos, table,
                q.shape[-1] ** -0.5 if scale is None else scale)


@triton_op("trtbuild::paged_attention", mutates_args=())
def paged_attention_op(q: Tensor, k_pool: Tensor, v_pool: Tensor, pos: Tensor, table: Tensor, scale: float) -> Tensor:
    """The kernel as a custom op: what the paged graph calls on CUDA."""
    return _run(wrap_triton(_paged_partial), wrap_triton(_paged_merge), wrap_triton(_paged_chunk), q, k_pool, v_pool,
                pos, table, scale)
