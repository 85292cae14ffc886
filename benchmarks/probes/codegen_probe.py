"""The decode matmuls' machine code for a GPU, read without one: registers, spills, and what each step's loop
does per weight.

Triton compiles for any target on the host (its wheel carries ptxas and nvdisasm), so the code a build would
run on an H100 can be read here, on the CPU, before a GPU is lent. For each configuration this compiles
`quant_matmul`'s kernel (int4, int8, fp8) or `decode_matmul`'s (bf16) exactly as a launch on a Hopper GPU
specializes it (pointers and the widths, strides and row count of the 1B shapes: divisible by 16; one row a
constant; the wait for the previous kernel compiled in, int4's nibbles by PTX) and reports, from the cubin:
  - registers a thread and stack bytes (a stack is spilled registers);
  - the main loop's instructions (the body between its label and the branch back), and per weight of a step
    (block_n x block_k / threads, doubled when gated): an issue-bound loop runs at most at four warp
    instructions a clock a multiprocessor;
  - the barriers and shared-memory moves in the loop (a layout conversion the compiler inserted);
  - whether the configuration with stages 3 compiles to the same code as with 1 (`--stages`).
Prints a table and writes codegen_probe.json under --out. Needs Triton (no GPU).

    python3 benchmarks/probes/codegen_probe.py --out /tmp/codegen
    python3 benchmarks/probes/codegen_probe.py --formats int4 --configs n8k512w4s1 --gate --out /tmp/codegen
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trtbuild.kernels.matmul_configs import MatmulConfig  # noqa: E402

ARCH = 90  # the H100's and the H200's
# 1B's gate/up: K 2048, N 8192 (the strides only need their divisibility by 16, which these have)
K, N, GROUP = 2048, 8192, 128
DEFAULT_CONFIGS = ["n2k2048w4s1", "n4k1024w4s1", "n4k2048w4s1", "n8k512w4s1", "n8k1024w4s1"]


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compile_kernel(fmt: str, config: MatmulConfig, rows: int, gate: bool) -> Any:
    """The kernel of `fmt` (bf16: the dense one) compiled for sm_90 as a launch at `rows` rows specializes it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    one = rows == 1
    if fmt == "bf16":
        from trtbuild.kernels import decode_matmul as dm

        fn = dm._decode_matmul_kernel
        args = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "g_ptr": "*bf16", "r_ptr": "*bf16",
                "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32",
                "stride_rm": "i32"}
        consts = {"BLOCK_M": 1 if one else 16, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
                  "USE_DOT": not one, "EVEN_K": True, "NORM": False, "GAIN": False, "EPS": 1e-5, "GATE": gate,
                  "RESIDUAL": False, "PDL": True, "SPLIT": 1, "K_SLICE": 0}
    else:
        from trtbuild.kernels import quant_matmul as qm

        fn = qm._quant_matmul_kernel
        args = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv" if fmt == "fp8" else "*i8", "s_ptr": "*bf16",
                "z_ptr": "*bf16", "y_ptr": "*bf16", "r_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32",
                "K_SLICE": "i32", "stride_xm": "i32", "stride_qn": "i32", "stride_sn": "i32", "stride_ym": "i32",
                "stride_rm": "i32"}
        consts = {"BLOCK_M": 1 if one else 16, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
                  "INT4": fmt == "int4", "GROUP": GROUP if fmt == "int4" else 2, "USE_DOT": not one,
                  "EVEN_K": True, "GATE": gate, "RESIDUAL": False, "PDL": True, "SPLIT": 1, "ASM": True}
    if one:  # a launch with one row passes M = 1, which Triton makes a constant
        consts["M"] = 1
    signature = {name: ("constexpr" if name in consts else kind) for name, kind in args.items()}
    signature.update({name: "constexpr" for name in consts if name not in signature})
    # what a launch's specialization says of the rest: every pointer and integer divisible by 16 (stride_rm is 0)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(signature)
             if signature[name] != "constexpr" and name != "stride_rm"}
    source = ASTSource(fn=fn, signature=signature, constexprs=consts, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", ARCH, 32),
                          options={"num_warps": config.warps, "num_stages": config.stages})


def read_code(kernel: Any) -> dict[str, Any]:
    """Registers, stack and the main loop's instructions of a compiled kernel, from its cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    ops: list[str] = []
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(ops)
        elif m := re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(.*?)\s*;", line):
            ops.append(m.group(1))
    loop: list[str] = []
    for i, op in enumerate(ops):  # the longest body that a branch back closes
        if (m := re.search(r"BRA\s+`\((\.L_x_\d+)\)", op)) and labels.get(m.group(1), i) < i:
            body = ops[labels[m.group(1)]:i + 1]
            loop = body if len(body) > len(loop) else loop
    names = collections.Counter((op.split()[1] if op.startswith("@") else op.split()[0]).split(".")[0]
                                for op in loop)
    body_text = "\n".join(re.sub(r"/\*[0-9a-f]+\*/", "", op) for op in ops)
    return {"registers": regs, "stack_bytes": stack, "loop_instructions": len(loop),
            "loop_barriers": names["BAR"], "loop_shared_moves": names["STS"] + names["LDS"],
            "loop_loads": names["LDG"], "loop_mix": dict(names.most_common(8)), "code": body_text}


def probe(fmt: str, name: str, rows: int, gate: bool, stages: bool) -> dict[str, Any]:
    config = MatmulConfig.parse(name)
    code = read_code(compile_kernel(fmt, config, rows, gate))
    weights = config.block_n * config.block_k * (2 if gate else 1) / (config.warps * 32)
    row: dict[str, Any] = {"format": fmt, "config": name, "rows": rows, "gate": gate,
                           **{k: v for k, v in code.items() if k != "code"},
                           "instructions_per_weight": round(code["loop_instructions"] / weights, 2)}
    if stages:
        other = MatmulConfig(config.block_n, config.block_k, config.warps, 3 if config.stages == 1 else 1,
                             config.split)
        row["same_code_as_" + other.name] = read_code(compile_kernel(fmt, other, rows, gate))["code"] == code["code"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--formats", nargs="+", default=["int4", "int8", "fp8", "bf16"],
                    choices=["int4", "int8", "fp8", "bf16"])
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS)
    ap.add_argument("--rows", nargs="+", type=int, default=[1])
    ap.add_argument("--gate", action="store_true", help="the gated call site (gate/up) too")
    ap.add_argument("--stages", action="store_true", help="compare each with its other stages (1 <-> 3)")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # quiet a warning of newer Triton; fusion stays on
    import triton

    rows_out = []
    print(f"Triton {triton.__version__}, sm_{ARCH}; K {K}, N {N}, int4 groups of {GROUP}")
    print(f"{'format':6} {'config':14} {'rows':>4} {'gate':>5} {'regs':>5} {'stack':>6} {'loop':>5} "
          f"{'/weight':>8} {'bars':>5} {'smem':>5}  same code, other stages")
    for fmt in args.formats:
        for rows in args.rows:
            for gate in (False, True) if args.gate else (False,):
                for name in args.configs:
                    try:
                        r = probe(fmt, name, rows, gate, args.stages)
                    except Exception as e:  # a configuration that does not compile is a result too
                        r = {"format": fmt, "config": name, "rows": rows, "gate": gate,
                             "error": f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"}
                        print(f"{fmt:6} {name:14} {rows:>4} {gate!s:>5} {r['error']}")
                        rows_out.append(r)
                        continue
                    same = next((f"{k[13:]}: {v}" for k, v in r.items() if k.startswith("same_code_as_")), "")
                    print(f"{fmt:6} {name:14} {rows:>4} {gate!s:>5} {r['registers']:>5} {r['stack_bytes']:>6} "
                          f"{r['loop_instructions']:>5} {r['instructions_per_weight']:>8} {r['loop_barriers']:>5} "
                          f"{r['loop_shared_moves']:>5}  {same}")
                    rows_out.append(r)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "codegen_probe.json").write_text(json.dumps(
        {"triton": triton.__version__, "arch": ARCH, "k": K, "n": N, "group": GROUP, "rows": rows_out}, indent=1))
    print(f"wrote {args.out / 'codegen_probe.json'}")


if __name__ == "__main__":
    main()
