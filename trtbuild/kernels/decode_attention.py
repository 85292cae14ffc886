"""A Triton attention kernel for decode: one new query per sequence against the filled part of the cache.

Why it exists: in the H200 profiles (benchmarks/RESULTS.md) a decode step's attention is three kernels
per layer (a cuBLAS batched matmul for the scores, a Triton softmax over them in fp32, a second
batched matmul for the values), 8-11 us per layer for a few hundred cache slots whose K and V are
~0.1 MB: it is launch and ramp, not reading. This is split-KV decoding ("flash-decoding") in two
launches. The first streams K and V once: each program owns one sequence, one KV head (with its
query heads stacked, so grouped-query attention reads each cached row once) and one slice of the
filled slots, and keeps an online softmax. The second merges the slices' partial results.

The filled length is read from the position tensor on the device, not from the graph's shapes: the
kernel reads exactly slots 0..pos, whatever window the runtime captured the step for. Every sequence has
its own position and its own cache row (`pos[b]`, `slots[b]`): a batch of sequences of different lengths,
in any rows of the cache, is one launch, each program reading only its own sequence's filled slots.

Registered as a custom op, which AOTInductor compiles into the decode packages:
`trtbuild::decode_attention_rope` takes the QKV projection's output as it is and also
rotates the query and the new key and writes the new key and value into the cache. In the H200 profile
of a 1B step, those were three Inductor kernels per layer (56 us of 1111 at batch 1, plus their launch
gaps) for a few kilobytes each; here they are a few loads in programs that run anyway.
Used for 16-bit models only: its dots run on tensor cores, which would round fp32 to tf32.
Imported only where Triton and a GPU are present; lives with the model code because its source is
part of every engine's key.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from trtbuild.kernels.grid_dependency import release_successor, wait_for_predecessor, waits_on
from trtbuild.kernels.grid_dependency import source_digest as wait_digest

BLOCK_S = 32  # cache slots per loop step: a (16 x D) by (D x 32) dot, and K and V tiles of 32 rows
TARGET_PROGRAMS = 256  # slices per step ~ two waves on the H200's 132 SMs, whatever the batch


def source_digest() -> str:
    """This file's content and its wait's: a compiled graph that calls the kernel is only reusable with the same kernel."""
    return hashlib.sha256(Path(__file__).read_bytes() + wait_digest().encode()).hexdigest()[:16]


def supports(head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> str | None:
    """None when the kernel can serve this attention, else why not (recorded in the manifest)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype} (the kernel's tensor-core dots would round fp32 to tf32)"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"head_dim {head_dim} (the kernel takes a power of two >= 16)"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > 16:
        return f"{num_heads} query heads over {num_kv_heads} KV heads (the kernel stacks at most 16 per KV head)"
    return None


def num_splits(batch: int, kv_heads: int) -> int:
    """Slices of the cache per (sequence, KV head): a power of two (the merge sums over them as a block)."""
    want = max(1, -(-TARGET_PROGRAMS // (batch * kv_heads)))
    return min(32, triton.next_power_of_2(want))


@triton.jit
def _slice_len(filled, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Slots per slice: the filled ones spread over SPLITS slices, rounded up to whole BLOCK_S tiles, so
    the first cdiv(filled, this) slices hold slots and the rest none. Slice 0 always holds slot 0."""
    return tl.cdiv(tl.cdiv(filled, SPLITS), BLOCK_S) * BLOCK_S


@triton.jit
def _rotate(ptr, cos, sin, d, HALF: tl.constexpr, mask):
    """One head's row at ptr, rotated in fp32 as `llama.apply_rope` does (half-split layout) and
    rounded back to the row's dtype; d = arange(D), `mask` broadcast against it (rows of a tile)."""
    x = tl.load(ptr + d, mask=mask, other=0.0).to(tl.float32)
    partner = tl.load(ptr + (d + HALF) % (2 * HALF), mask=mask, other=0.0).to(tl.float32)
    # first half: x1 * cos - x2 * sin; second half: x2 * cos + x1 * sin
    return (x * cos + tl.where(d < HALF, -partner, partner) * sin).to(ptr.dtype.element_ty)


@triton.jit
def _decode_attention_partial(q_ptr, rope_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, o_ptr, ml_ptr, KV,
                              stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
                              REP: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                              SPLITS: tl.constexpr, SCALE: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # may start before the QKV projection completes (grid_dependency.py): every address waits for it
        z = wait_for_predecessor()
        q_ptr, rope_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, o_ptr, ml_ptr = (
            q_ptr + z, rope_ptr + z, k_ptr + z, v_ptr + z, pos_ptr + z, slot_ptr + z, o_ptr + z, ml_ptr + z)
    bkv = tl.program_id(0)  # sequence * KV + KV head
    split = tl.program_id(1)
    b = bkv // KV
    kv = bkv % KV
    pos = tl.load(pos_ptr + b)  # this sequence's position, and below its row of the cache
    row_c = tl.load(slot_ptr + b)
    filled = pos + 1  # slots 0..pos, the step's own included
    per = _slice_len(filled, SPLITS, BLOCK_S)
    start = split * per
    end = tl.minimum(start + per, filled)
    r = tl.arange(0, BLOCK_R)
    d = tl.arange(0, D)
    r_mask = r < REP
    k_base = k_ptr + row_c * stride_kb + kv * stride_kh
    v_base = v_ptr + row_c * stride_vb + kv * stride_vh
    if ROPE:
        j = d % (D // 2)
        cos = tl.load(rope_ptr + pos * D + 2 * j)
        sin = tl.load(rope_ptr + pos * D + 2 * j + 1)
    # query head kv * REP + r uses KV head kv (Hugging Face's repeat_kv order); rows past REP are
    # padding for the tensor-core dot, masked to zero and never stored
    q_rows = q_ptr + b * stride_qb + (kv * REP + r)[:, None] * stride_qh
    if ROPE:
        # q_ptr is the QKV projection's row [q heads | k heads | v heads] (stride_qh = D): rotate the
        # query and the new key by the table's row for pos, and store the new key and value in the
        # cache. The slice that holds slot pos stores them, and attends to that slot from its registers'
        # copy after the loop, rather than reading back what it stored.
        q = _rotate(q_rows, cos[None, :], sin[None, :], d[None, :], D // 2, r_mask[:, None])
        new_k = _rotate(q_ptr + b * stride_qb + (KV * REP + kv) * D, cos, sin, d, D // 2, d < D)
        new_v = tl.load(q_ptr + b * stride_qb + (KV * REP + KV + kv) * D + d)
        owner = (start <= pos) & (pos < end)
        at = d * 0 + pos  # the store's mask as a vector: Triton's interpreter takes no scalar in a mask
        stores = (start <= at) & (at < end)
        tl.store(k_base + pos * stride_ks + d, new_k, mask=stores)
        tl.store(v_base + pos * stride_vs + d, new_v, mask=stores)
        # The loop reads only slots before pos. Selecting the register copy for slot pos inside it
        # (a where on every loaded tile of K and V, an earlier design) made the loop
        # stream the cache slower: on the H200 (RESULTS.md) 52.6 against 39.4 us a
        # layer for the kernel without rope at 8B shapes, batch 8, position 4000.
        loop_end = tl.minimum(end, pos)
    else:
        # the step's own K and V are already in the cache at slot pos
        q = tl.load(q_rows + d[None, :], mask=r_mask[:, None], other=0.0)
        loop_end = end
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, D], tl.float32)
    for s0 in range(start, loop_end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_mask = s < loop_end
        k = tl.load(k_base + s[:, None] * stride_ks + d[None, :], mask=s_mask[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * SCALE
        scores = tl.where(s_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        total = total * alpha + tl.sum(p, 1)
        v = tl.load(v_base + s[:, None] * stride_vs + d[None, :], mask=s_mask[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    if ROPE:
        # slot pos, in the slice that holds it: one more step of the same online softmax, its weight
        # rounded to the cache's dtype for the product with V as the loop's are before their dot
        score = tl.sum(q.to(tl.float32) * new_k.to(tl.float32)[None, :], 1) * SCALE
        score = tl.where(owner, score, float("-inf"))
        m_new = tl.maximum(m, score)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a slice with no slot at all stays empty
        alpha = tl.exp(m - m_ref)
        p = tl.exp(score - m_ref)
        total = total * alpha + p
        acc = acc * alpha[:, None] + p.to(new_v.dtype).to(tl.float32)[:, None] * new_v.to(tl.float32)[None, :]
        m = m_new
    # Partials, unnormalized, of the query rows only, and only from a slice that holds filled slots: the
    # merge reads no others. Slices past the filled length (most of them in a short sequence: 27 of 32 at
    # 129 slots) and the padding rows would otherwise write, and the merge read, about 2 MB a layer on
    # Llama-3-8B shapes that it then weighs by exp(-inf) = 0.
    row = (bkv * SPLITS + split) * BLOCK_R + r
    keep = r_mask & ((r * 0 + start) < end)  # (as a vector, for the same reason)
    if PDL:  # the cache is read: the merge may be scheduled (it waits for this kernel to complete)
        acc = release_successor(acc)
    tl.store(o_ptr + row[:, None] * D + d[None, :], acc, mask=keep[:, None])
    tl.store(ml_ptr + row * 2, m, mask=keep)
    tl.store(ml_ptr + row * 2 + 1, total, mask=keep)


@triton.jit
def _decode_attention_merge(o_ptr, ml_ptr, y_ptr, pos_ptr, KV, stride_yb, stride_yh,
                            REP: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
                            BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    """One query head's output from the SPLITS partials of its sequence and KV head."""
    if PDL:  # may start before the partials are written: every address waits for them
        z = wait_for_predecessor()
        o_ptr, ml_ptr, y_ptr, pos_ptr = o_ptr + z, ml_ptr + z, y_ptr + z, pos_ptr + z
    pid = tl.program_id(0)  # sequence * heads + head
    b = pid // (KV * REP)
    h = pid % (KV * REP)
    filled = tl.load(pos_ptr + b) + 1
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, D)
    # the slices that hold filled slots, the only ones the partial kernel wrote (slice 0 always: the
    # maximum below is finite); the others load as m = -inf, total = 0, o = 0 and weigh nothing.
    held = sp < tl.cdiv(filled, _slice_len(filled, SPLITS, BLOCK_S))
    row = ((b * KV + h // REP) * SPLITS + sp) * BLOCK_R + h % REP
    m = tl.load(ml_ptr + row * 2, mask=held, other=float("-inf"))
    total = tl.load(ml_ptr + row * 2 + 1, mask=held, other=0.0)
    weight = tl.exp(m - tl.max(m, 0))
    o = tl.load(o_ptr + row[:, None] * D + d[None, :], mask=held[:, None], other=0.0)
    y = tl.sum(o * weight[:, None], 0) / tl.sum(total * weight, 0)
    if PDL:  # the output projection may be scheduled (it waits for this kernel to complete)
        y = release_successor(y)
    tl.store(y_ptr + b * stride_yb + h * stride_yh + d, y.to(y_ptr.dtype.element_ty))


def _run(partial: object, merge: object, q: Tensor, rope: Tensor | None, k_cache: Tensor, v_cache: Tensor,
         pos: Tensor, slots: Tensor, heads: int) -> Tensor:
    """q: [B, 1, H, D] after rope, or with `rope` the QKV projection's output [B, 1, (H + 2 KV) D]; pos and
    slots [B] (each sequence's position and cache row, contiguous)."""
    b, t = q.shape[:2]
    kv, d = k_cache.shape[1], k_cache.shape[3]
    width = (heads + 2 * kv) * d if rope is not None else d
    if (t != 1 or q.shape[-1] != width or q.stride(-1) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1
            or heads % kv or pos.shape != (b,) or slots.shape != (b,) or pos.stride(0) != 1 or slots.stride(0) != 1):
        raise ValueError(f"decode_attention takes q [B, 1, H, D] or QKV [B, 1, (H + 2 KV) D], caches "
                         f"[B', KV, S, D] with contiguous rows and contiguous pos and slots [B], got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(pos.shape)}, {tuple(slots.shape)}")
    rep, splits = heads // kv, num_splits(b, kv)
    pdl = waits_on(q.device)
    block_r = max(16, triton.next_power_of_2(rep))
    o = torch.empty((b * kv, splits, block_r, d), dtype=torch.float32, device=q.device)
    ml = torch.empty((b * kv, splits, block_r, 2), dtype=torch.float32, device=q.device)
    y = torch.empty((b, 1, heads, d), dtype=q.dtype, device=q.device)
    stride_qh = d if rope is not None else q.stride(2)
    # Without ROPE, pos stands in for the table's pointer (a compile-time flag keeps it from being read).
    partial[(b * kv, splits)](  # type: ignore[index]
        q, rope if rope is not None else pos, k_cache, v_cache, pos, slots, o, ml, kv,
        q.stride(0), stride_qh, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        # the scale a compile-time constant: AOTInductor passes a float argument as fp64, which would
        # promote the scores and the running maximum to fp64 (refused by Triton inside the loop)
        REP=rep, BLOCK_R=block_r, D=d, BLOCK_S=BLOCK_S, SPLITS=splits, SCALE=d**-0.5, ROPE=rope is not None,
        PDL=pdl, num_warps=4)
    merge[(b * heads,)](  # type: ignore[index]
        o, ml, y, pos, kv, y.stride(0), y.stride(2), REP=rep, BLOCK_R=block_r, D=d, SPLITS=splits, BLOCK_S=BLOCK_S,
        PDL=pdl, num_warps=1)
    return y


def _rows(b: int, pos: Tensor, slots: Tensor | None) -> tuple[Tensor, Tensor]:
    """An eager call's positions and cache rows as the kernels take them: one position for every sequence
    ((1,) or a scalar) made one a sequence, and no slots meaning rows 0..B-1."""
    pos = pos.reshape(-1).expand(b).contiguous() if pos.numel() == 1 else pos.reshape(b).contiguous()
    return pos, torch.arange(b, device=pos.device) if slots is None else slots.reshape(b).contiguous()


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor, slots: Tensor | None = None) -> Tensor:
    """Attention of q [B, 1, H, D] (after rope) at positions pos (one for all, or [B]) over the caches
    [B', KV, S, D], reading slots 0..pos[b] of cache row slots[b] (default: rows 0..B-1). Returns
    [B, 1, H, D]. An eager launch."""
    pos, slots = _rows(q.shape[0], pos, slots)
    return _run(_decode_attention_partial, _decode_attention_merge, q, None, k_cache, v_cache, pos, slots, q.shape[2])


def decode_attention_rope(qkv: Tensor, rope: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor,
                          heads: int, slots: Tensor | None = None) -> Tensor:
    """The same from the QKV projection's output [B, 1, (H + 2 KV) D]: rotates each sequence's query and new
    key by rope[pos[b]] (the model's (max_seq_len, D/2, 2) table), stores the new key and value in cache
    row slots[b] at slot pos[b], then attends. Returns [B, 1, H, D]. An eager launch."""
    pos, slots = _rows(qkv.shape[0], pos, slots)
    return _run(_decode_attention_partial, _decode_attention_merge, qkv, rope, k_cache, v_cache, pos, slots, heads)


@triton_op("trtbuild::decode_attention_rope", mutates_args=("k_cache", "v_cache"))
def decode_attention_rope_op(qkv: Tensor, rope: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor,
                             slots: Tensor, heads: int) -> Tensor:
    """The kernel as a custom op with rope and the cache writes: what the decode graphs call."""
    return _run(wrap_triton(_decode_attention_partial), wrap_triton(_decode_attention_merge), qkv, rope, k_cache, v_cache,
                pos, slots, heads)

