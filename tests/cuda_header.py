"""cuda.h as a C compiler reads it, to check trtbuild's ctypes calls into libcuda on a machine without a GPU.

A test double cannot see how ctypes hands an argument to the driver: a wrong width, a missing level of
pointer or a struct laid out differently would not fail on a GPU, it would corrupt memory or end the
process. So the calls a double records are checked against the header's prototypes, after the C
preprocessor has mapped each name to the symbol a C caller links (cuMemAlloc is cuMemAlloc_v2), and the
structures trtbuild mirrors against the compiler's own sizeof and offsetof. The headers are whatever this
machine has (a CUDA toolkit's, the one Triton bundles); a test is skipped where there is none.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

Kind = tuple[str, Any]  # ("int" | "uint", bytes), ("ptr", what it points to), ("struct", name), ("void", 0)


def headers() -> list[Path]:
    """The cuda.h files on this machine, one per folder."""
    roots = [os.environ.get("CUDA_HOME", ""), *sorted(glob.glob("/usr/local/cuda*"))]
    found = [Path(r) / "include" / "cuda.h" for r in roots if r]
    spec = importlib.util.find_spec("triton")  # located, not imported
    if spec is not None and spec.submodule_search_locations:
        found += [Path(p) / "backends" / "nvidia" / "include" / "cuda.h" for p in spec.submodule_search_locations]
    unique = {p.resolve(): p for p in found if p.is_file()}
    return sorted(unique)


def _compiler() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to read cuda.h with")
    return cc


class Header:
    """One cuda.h, preprocessed: its CUresult functions by linked name, and its typedefs."""

    def __init__(self, path: Path) -> None:
        self.path = path
        text = subprocess.run([_compiler(), "-E", "-P", "-x", "c", "-I", str(path.parent), "-"],
                              input="#include <cuda.h>\n", capture_output=True, text=True, check=True).stdout
        self.functions = {name: [p.strip() for p in params.split(",")]
                          for name, params in re.findall(r"CUresult\s+(\w+)\s*\(([^()]*)\)\s*;", text)}
        self.typedefs: dict[str, str] = {name: base.strip() + stars for base, stars, name in
                                         re.findall(r"typedef\s+([\w ]*?)\s*(\**)\s*(\w+)\s*;", text)}
        for name in re.findall(r"typedef\s+struct\s+\w+\s*\*\s*(\w+)\s*;", text):
            self.typedefs[name] = "void *"  # a handle: a pointer to a struct the header never defines
        self.structs = set(re.findall(r"typedef\s+struct\s+\w*\s*\{[^{}]*\}\s*(\w+)\s*;", text))
        self.enums = set(re.findall(r"typedef\s+enum\s+\w*\s*\{[^{}]*\}\s*(\w+)\s*;", text))

    def kind(self, ctype: str) -> Kind:
        """What a C type is, typedefs resolved (LP64, as on the GPU hosts); unknown types fail the test."""
        ctype = re.sub(r"\b(const|struct)\b", "", ctype).strip()
        if ctype.endswith("*"):
            return ("ptr", self.kind(ctype[:-1]))
        if ctype in self.typedefs:
            return self.kind(self.typedefs[ctype])
        if ctype in self.structs:
            return ("struct", ctype)
        if ctype in self.enums:
            return ("int", 4)
        words = ctype.split()
        if ctype == "void":
            return ("void", 0)
        assert words and set(words) <= {"unsigned", "signed", "int", "long", "char"}, f"{self.path}: type {ctype!r}"
        size = 8 if "long" in words else 1 if "char" in words else 4
        return ("uint" if "unsigned" in words else "int", size)

    def check(self, calls: list[tuple[str, tuple[Any, ...]]], structs: dict[type, str]) -> None:
        """Each recorded call (name, ctypes arguments) against the prototype of the symbol it names.
        `structs` names the C struct each ctypes.Structure passed mirrors (`layouts` checks them)."""
        for name, args in calls:
            assert name in self.functions, f"{name}: not a symbol cuda.h links ({self.path})"
            params = self.functions[name]
            assert len(args) == len(params), (name, params)
            for arg, param in zip(args, params, strict=True):
                c_type = re.sub(r"\s*\b\w+$", "", param) if re.search(r"[\w*]\s+\**\w+$", param) else param
                expected = self.kind(c_type)
                got = _arg_kind(arg, structs)
                if got == ("ptr", None):  # NULL: any pointer
                    assert expected[0] == "ptr", (name, param)
                elif expected == ("ptr", ("void", 0)):  # void *: any address
                    assert got[0] == "ptr", (name, param, arg)
                else:
                    assert got == expected, (name, param, got, expected)


def _arg_kind(arg: Any, structs: dict[type, str]) -> Kind:
    if arg is None:
        return ("ptr", None)
    target = getattr(arg, "_obj", None)  # ctypes.byref(x): a pointer to x
    if target is not None:
        return ("ptr", _arg_kind(target, structs))
    if isinstance(arg, ctypes.Array):
        return ("ptr", _type_kind(arg._type_, structs))
    return _type_kind(type(arg), structs)


def _type_kind(t: Any, structs: dict[type, str]) -> Kind:
    if issubclass(t, ctypes.Structure):
        return ("struct", structs[t])
    if issubclass(t, ctypes.c_void_p | ctypes.c_char_p):
        return ("ptr", ("void", 0) if issubclass(t, ctypes.c_void_p) else ("int", 1))
    return ("int" if t(-1).value < 0 else "uint", ctypes.sizeof(t))


def check_layouts(path: Path, structs: dict[Any, tuple[str, dict[str, tuple[str, ...]]]]) -> None:
    """Each ctypes Structure against the C struct it mirrors, as this cuda.h's compiler lays it out: the
    struct's size, and each field's offset and size. `structs` maps a Structure to its C struct and
    {its field: the C fields it covers} (one, or several for an array such as grid[3] = gridDimX..Z)."""
    got = layouts(path, structs, [])
    for struct, (c_name, fields) in structs.items():
        assert got[c_name] == ctypes.sizeof(struct), c_name
        for ours, theirs in fields.items():
            field = getattr(struct, ours)
            assert got[f"{c_name}.{theirs[0]}"] == field.offset, (c_name, ours)
            assert sum(got[f"sizeof {c_name}.{t}"] for t in theirs) == field.size, (c_name, ours)
            if len(theirs) > 1:  # an array over several C fields: one element each, of their width
                t = dict(struct._fields_)[ours]
                assert t._length_ == len(theirs), (c_name, ours)
                assert all(got[f"sizeof {c_name}.{c}"] == ctypes.sizeof(t._type_) for c in theirs), (c_name, ours)
            for a, b in zip(theirs, theirs[1:], strict=False):  # the C fields an array covers lie back to back
                assert got[f"{c_name}.{a}"] + got[f"sizeof {c_name}.{a}"] == got[f"{c_name}.{b}"], (c_name, ours)


def layouts(path: Path, structs: dict[type, tuple[str, dict[str, tuple[str, ...]]]], constants: list[str]) -> dict[str, int]:
    """sizeof, offsetof and the values of `constants`, as a C compiler gives them with this cuda.h:
    {"<struct>": size, "<struct>.<C field>": offset, "sizeof <struct>.<C field>": size, "<constant>": value}."""
    lines, names = [], []
    for _, (c_name, fields) in structs.items():
        lines.append(f"(long long)sizeof({c_name})")
        names.append(c_name)
        for c_field in (f for covered in fields.values() for f in covered):
            lines += [f"(long long)offsetof({c_name}, {c_field})", f"(long long)sizeof((({c_name} *)0)->{c_field})"]
            names += [f"{c_name}.{c_field}", f"sizeof {c_name}.{c_field}"]
    lines += [f"(long long)({c})" for c in constants]
    names += constants
    source = ("#include <cuda.h>\n#include <stddef.h>\n#include <stdio.h>\nint main(void) {\n"
              + "".join(f'    printf("%lld\\n", {expr});\n' for expr in lines) + "    return 0;\n}\n")
    with tempfile.TemporaryDirectory() as tmp:
        build = Path(tmp)
        (build / "layout.c").write_text(source)
        subprocess.run([_compiler(), "-I", str(path.parent), "-o", str(build / "layout"), str(build / "layout.c")],
                       check=True, capture_output=True)
        out = subprocess.run([str(build / "layout")], check=True, capture_output=True, text=True).stdout.split()
    return dict(zip(names, map(int, out), strict=True))
