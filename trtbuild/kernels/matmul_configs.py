"""The decode matmul's launch configurations: what the build times per weight shape and batch size.

Kept apart from the kernel (`decode_matmul`) on purpose. The kernel's source digest is in the key of
every compiled graph that calls it and of every cached timing; the candidate lists are not kernel code,
so changing them must not throw those away. A cached timing records the names of the candidates it
timed instead (`decode_kernels._timings`), so a new list times again only the batches whose list
changed, and a graph whose chosen configuration is unchanged is reused. Plain Python, no Triton: the
lists can be read and tested anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MatmulConfig:
    """One candidate kernel: the launch shape the build (and the probe) times per weight shape."""

    block_n: int
    block_k: int
    warps: int
    stages: int
    split: int = 1  # programs sharing one block of columns, each a slice of k (split-K; plain matmul only)

    @property
    def name(self) -> str:
        return f"n{self.block_n}k{self.block_k}w{self.warps}s{self.stages}" + (f"p{self.split}" if self.split > 1 else "")

    @classmethod
    def parse(cls, name: str) -> "MatmulConfig":
        n, rest = name[1:].split("k")
        k, rest = rest.split("w")
        w, rest = rest.split("s")
        s, _, p = rest.partition("p")
        return cls(int(n), int(k), int(w), int(s), int(p or 1))


# Candidates per row count. One row: a multiply-and-sum over BLOCK_N weight rows; several: a tensor-core
# dot with the rows padded to 16 (the padding is masked, never read). Chosen from the H200 probe
# (benchmarks/probes/matmul_probe.py): narrow blocks give the 4096-row matrices enough programs per SM.
# Two and four rows with k steps of 2048: the fastest of 64 one-row configurations at every 1B call site in
# the H100 probe of 2026-12-05 (0.6-1.8 us a call under the best of the rest; the step's matmuls 1.032 ->
# 0.967 ms; RESULTS.md). The build times them beside the others on its own GPU.
ONE_ROW = [MatmulConfig(n, k, w, s) for n in (4, 8, 16, 32) for k in (256, 512, 1024) for w in (4,) for s in (1, 3)] + [
    MatmulConfig(n, 1024, 8, s) for n in (16, 32) for s in (1, 3)] + [
    MatmulConfig(n, 2048, 4, s) for n in (2, 4) for s in (1, 3)]
# A k step of 4096, for rows of at least 4096 only (narrower rows would mask half of every step): the
# fastest of 64 one-row configurations at the 8B QKV, gate/up and LM head in the H200 probe of 2026-12-05
# (0.5-7.4 us a call under the build's best; the step's matmuls 3.861 -> 3.757 ms; RESULTS.md).
# Kept out of narrower rows' lists, so their cached timings stay valid.
ONE_ROW_WIDE_K = [MatmulConfig(2, 4096, 4, s) for s in (1, 3)]
ROWS = [MatmulConfig(n, k, 4, s) for n in (16, 32, 64) for k in (128, 256, 512) for s in (3, 4)] + [
    MatmulConfig(64, k, 8, s) for k in (256, 512) for s in (3, 4)]
# Split-K, for the plain matmul only (a norm needs the whole row, gating and the residual the final sum),
# timed only with options.decode_split_k timed (on the H200: kept for the 1B down projection at batch 1,
# −22 µs a step; none kept at 8B; RESULTS.md).
# Like every candidate, the build keeps one only where it measured faster, and refuses one whose result
# differs from ATen's.
ONE_ROW_SPLIT = [MatmulConfig(n, k, 4, 3, p) for n in (8, 16, 32) for k in (512, 1024) for p in (2, 4)]
ROWS_SPLIT = [MatmulConfig(n, k, 4, 4, p) for n in (16, 32) for k in (256, 512) for p in (2, 4)]


# What tactics `default` times (`candidates(..., full=False)`): the configurations that came within a few per
# cent of the best at some 1B or 8B call site on the H100 or the H200 (RESULTS.md; the H100 gate's timings of
# 2026-12-06: at one row n2k2048 and n4k2048 led at every 1B site, n4k2048s3 and n8k1024 at the LM head; at
# eight rows n16k512w4s4, n32k512w4s4, n32k128w4s3 and n64k128 led). A cold build compiles and times a third
# of the kernels; `max` times every list in full.
LIKELY = frozenset({
    "n2k2048w4s1", "n2k2048w4s3", "n4k2048w4s1", "n4k2048w4s3", "n4k1024w4s3", "n8k1024w4s1", "n8k1024w4s3",
    "n8k512w4s1", "n2k4096w4s1", "n2k4096w4s3",
    "n16k512w4s3", "n16k512w4s4", "n32k512w4s3", "n32k512w4s4", "n32k256w4s4", "n32k128w4s3", "n32k128w4s4",
    "n64k128w4s3", "n64k128w4s4", "n64k256w4s3"})


def candidates(rows: int, fusion: str = "none", split: bool = False, k: int = 0, n: int = 0,
               full: bool = True) -> list[MatmulConfig]:
    """The configurations timed for `rows` at a call site with `fusion` whose rows are `k` wide; with
    `split`, split-K ones too; without `full`, only the unsplit ones in LIKELY (the split-K lists are kept).
    Given the weight's `n` output columns and `k`, a configuration whose block
    covers more than the whole matrix is dropped where one before it in the list covers the same (the
    masked rest of a block is never read, so the two do the same work): a small model's tactic selection
    then compiles and times a handful of kernels instead of every one (a 2-layer test model's bf16 build
    spent most of 330 s there on an H100). Weights of a thousand columns and rows or more drop none."""
    plain = ONE_ROW + [c for c in ONE_ROW_WIDE_K if k >= c.block_k] if rows == 1 else ROWS
    if not full:
        plain = [c for c in plain if c.name in LIKELY]
    listed = plain + (ONE_ROW_SPLIT if rows == 1 else ROWS_SPLIT) if split and fusion == "none" else plain
    if rows == 1:
        listed = one_stage(listed)
    if not (n and k):
        return listed
    floor_n = 16 if rows > 1 else 1  # the tensor-core dot needs 16 columns, whatever the matrix
    kept: dict[tuple[int, ...], MatmulConfig] = {}
    for c in listed:
        covers = (max(floor_n, min(c.block_n, _pow2(n))), min(c.block_k, _pow2(k)), c.warps, c.stages,
                  min(c.split, max(1, k // 16)))
        kept.setdefault(covers, c)
    return list(kept.values())


def one_stage(configs: list[MatmulConfig]) -> list[MatmulConfig]:
    """The one-row configurations without those that differ from an earlier one only in their stages: a
    one-row loop has no tensor-core dot, so Triton's software pipelining (`num_stages`) leaves it alone, and the
    two compile to the same machine code (stages 1 and 3 of the dense, int4, int8 and fp8 one-row kernels
    compared instruction by instruction for the H100, Triton 3.6: `benchmarks/probes/codegen_probe.py`). Timing
    both only doubled the compiles and let timing noise choose between equals."""
    kept: dict[tuple[int, int, int, int], MatmulConfig] = {}
    for c in configs:
        kept.setdefault((c.block_n, c.block_k, c.warps, c.split), c)
    return list(kept.values())


def _pow2(x: int) -> int:
    """The power of two at or above x: the smallest block that covers x."""
    return 1 << max(0, (x - 1).bit_length())


# The quantized decode matmul's candidates (kernels/quant_matmul.py), per stored format (fp8 and int8 share
# theirs) and row count: the same launch shapes as the dense kernel's, timed per weight shape and batch by
# the build, none yet measured on a GPU. Its one-row path is a multiply-and-sum; 2+ rows a tensor-core dot.
# The dense kernel's fastest one-row shapes stream 2-4 weight rows with 2048-column steps (RESULTS.md): the
# same byte counts a step are 1024-4096 int4 columns, so the int4 steps reach 2048 columns (16 groups of
# 128). Split-K gives a short, wide matrix (the 1B down projection) enough programs for every SM.
QUANT_ONE_ROW = {
    "int4": [MatmulConfig(n, k, 4, s) for n in (2, 4, 8, 16) for k in (512, 1024, 2048) for s in (1, 3)],
    "fp8": [MatmulConfig(n, k, 4, s) for n in (2, 4, 8, 16) for k in (512, 1024, 2048) for s in (1, 3)],
}
QUANT_ROWS = {
    # no 16-column blocks: their dequantized tile goes to the tensor cores through three times the
    # instructions a weight of 32 or 64 columns (22-26 against 6-8, codegen_probe, Triton 3.6), and none won a
    # 1B or 8B shape in the H100 probe (RESULTS.md)
    "int4": [MatmulConfig(n, k, 4, s) for n in (32, 64) for k in (256, 512) for s in (1, 3)],
    "fp8": [MatmulConfig(n, k, 4, s) for n in (16, 32, 64) for k in (128, 256, 512) for s in (3,)],
}
QUANT_ONE_ROW_SPLIT = [MatmulConfig(n, k, 4, 1, p) for n, k in ((4, 512), (8, 512), (8, 1024), (16, 1024))
                       for p in (2, 4)]
QUANT_ROWS_SPLIT = [MatmulConfig(n, 256, 4, 3, p) for n in (16, 32) for p in (2, 4)]
# an int4 step is unrolled into one block of code per group: more than this many groups a step is not a
# candidate (and the launcher shortens a fixed configuration's step to it)
MAX_GROUPS_A_STEP = 16
# int4 dequantizes a step's bytes into fp32 tiles of block_n x block_k / 2 (and on one row keeps a partial sum
# for each): at most this many for four warps (64 registers a thread), so that a larger step does not spill
INT4_TILE = 8192
H100_SMS = 132  # the pruning's multiprocessor count where no device is there to ask


def quant_candidates(fmt: str, rows: int, n: int, k: int, group: int = 0, sms: int = H100_SMS,
                     epilogue: str = "none") -> list[MatmulConfig]:
    """The configurations the build times for a quantized weight of format `fmt` (fp8, int8, int4; int4 in
    groups of `group` columns), `n` output columns x `k`, at `rows` rows, with `epilogue` (none, gate: two
    weight rows an output column, residual), pruned of those that cannot win at that shape:
    - a step or a block of columns at least twice the matrix's (half of every step masked: the half-size
      candidate reads the same bytes in fewer, fuller steps), the list's smallest excepted;
    - int4 steps that are not whole groups, or more than MAX_GROUPS_A_STEP of them; int4 steps
      whose dequantized tile is larger than INT4_TILE for four warps, and fp8/int8 one-row steps whose tile of
      partial sums is (past it, the registers spill: 255 a thread and a stack, in the compiled code);
    - at one row, a configuration that differs from an earlier one only in its stages (`one_stage`);
    - split-K where the unsplit launch already gives every one of `sms` multiprocessors 4 programs or more (the
      split only adds a reduction), or where a slice of k would be shorter than one step. (With an epilogue,
      the gating or the add, the reduction does it.)
    The lists' order is kept: the selection's first of equals is the earlier."""
    family = "int4" if fmt == "int4" else "fp8"
    plain = (QUANT_ONE_ROW if rows == 1 else QUANT_ROWS)[family]
    split = QUANT_ONE_ROW_SPLIT if rows == 1 else QUANT_ROWS_SPLIT
    if rows > 1 and family == "int4":  # as its QUANT_ROWS list: no 16-column blocks
        split = [c for c in split if c.block_n >= 32]
    if rows == 1:
        plain, split = one_stage(plain), one_stage(split)
    # (the list's smallest step and block always stay: a matrix narrower than them still needs a candidate)
    width = max(_pow2(k), min(c.block_k for c in plain))
    height = max(_pow2(n), min(c.block_n for c in plain))
    rows_read = 2 if epilogue == "gate" else 1  # weight rows a column: gating dequantizes two tiles a step

    def fits(c: MatmulConfig) -> bool:
        if c.block_k > width or c.block_n > height:
            return False
        if family == "int4" and (c.block_k % group or c.block_k // group > MAX_GROUPS_A_STEP):
            return False
        if family == "int4" and rows_read * c.block_n * c.block_k // 2 > INT4_TILE * c.warps // 4:
            return False
        # fp8 and int8 on one row keep a [block_n, block_k] fp32 tile of partial sums a weight matrix
        if family == "fp8" and rows == 1 and rows_read * c.block_n * c.block_k > INT4_TILE * c.warps // 4:
            return False
        return c.split == 1 or (-(-n // c.block_n) < 4 * sms and k // c.split >= c.block_k)

    return [c for c in plain + split if fits(c)]
