"""The repository as a reader meets it: it speaks of itself only, its modules import each other without
cycles, and the README stays short."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

from .conftest import REPO

# How the work was organised is not the project's business: measurements are named by date, device,
# commit and command. Ordinals past "fourth" written as words only ever named work periods here.
_ORDINAL = (r"(?:seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|"
            r"sixteenth|seventeenth|eighteenth|nineteenth|twentieth|thirtieth|(?:twenty|thirty)-"
            r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth))")
SELF_REFERENCE = re.compile("|".join([
    rf"\b{_ORDINAL}\b",
    r"\b(?:this|that|next|previous|earlier|later|last|same) (?:device |work )?sessions?\b(?![.(\w])",
    r"\b(?:first|second|third|fourth|fifth|sixth) sessions?\b",
    r"\bsessions? \d+\b",
    r"\b(?:issue|task|ticket)s? #?\d+\b",
    r"\bthe (?:benchmark|newcomer|house) issue\b",
    r"\bcalls? \d{1,3}\b",
]), re.IGNORECASE)
# `Session` is the API's name for an open engine: "a session" / "the session" in that sense stay allowed.
ALLOWED = re.compile(r"\b(?:that|this|same) session\b(?= (?:frees|is open|holds|object))", re.IGNORECASE)


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    files = []
    for rel in out.splitlines():
        path = REPO / rel
        if rel == "tests/test_house.py" or not path.is_file() or path.stat().st_size > 2_000_000:
            continue
        if path.suffix in {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".json", ".log", ""}:
            files.append(path)
    return files


def test_no_file_speaks_of_sessions_issues_or_how_the_work_was_organised() -> None:
    found = []
    for path in _tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            for m in SELF_REFERENCE.finditer(line):
                if not ALLOWED.match(line, m.start()):
                    found.append(f"{path.relative_to(REPO)}:{n}: {m.group(0)!r}")
    assert not found, "\n".join(found[:40]) + (f"\n... {len(found) - 40} more" if len(found) > 40 else "")


def test_the_pattern_catches_what_it_must() -> None:
    for text in ("RESULTS.md, seventeenth session", "the twenty-fourth", "issue 3", "call 69", "in this session",
                 "the next device session", "Issue #12"):
        assert SELF_REFERENCE.search(text), text
    for text in ("open_session(recipe)", "with session:", "a session frees its weights", "Session.generate",
                 "the session's phases", "recall 5 tokens"):
        m = SELF_REFERENCE.search(text)
        assert m is None or ALLOWED.match(text, m.start()), text


def _imports(path: Path, package_root: Path, modules: set[str]) -> set[str]:
    """Every trtbuild module a file imports, at the top, inside functions, or for type checking alone."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module = ".".join(path.relative_to(package_root.parent).with_suffix("").parts)
    if module.endswith(".__init__"):
        module = module[: -len(".__init__")]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("trtbuild")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trtbuild"):
            # `from trtbuild.pkg import mod` imports the module; `from trtbuild.pkg import name`, the package
            submodules = {f"{node.module}.{a.name}" for a in node.names}
            known = {m for m in submodules if m in modules}
            found |= known
            if known != submodules:
                found.add(node.module)
    return {m for m in found if m != module}


def _import_graph() -> dict[str, set[str]]:
    """Each module of the package, with the modules of the package that it imports."""
    root = REPO / "trtbuild"
    modules: dict[str, Path] = {}
    for path in root.rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return {name: {m for m in _imports(path, root, set(modules)) if m in modules} for name, path in modules.items()}


def test_no_module_of_the_package_imports_itself_through_others() -> None:
    graph = _import_graph()
    cycles = []
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    assert not cycles, f"modules that import each other: {cycles}"


# The package's top level is the pipeline's stages, from the top floor down: a module may import its own stage
# or any stage on a floor below it, never one above (the HTTP server may use generation; the store never a backend).
FLOORS: list[set[str]] = [
    {"__init__", "__main__", "cli"},  # the faces: the Python API and the command line
    {"runner", "serving", "measure"},  # a built engine run, served, measured
    {"builder"},  # key -> hit, or lock -> build -> publish: where recipe, store and backend meet
    {"backends"},
    {"models", "kernels"},
    {"recipe", "store"},
    {"errors", "version", "registry", "parallel", "timing"},  # leaves
]


def _stage(module: str) -> str:
    """`trtbuild.store.local` -> `store`; the package itself is its `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _floor(module: str) -> int:
    """0 for the top floor; a stage missing from FLOORS fails the test below, not this lookup."""
    return next((n for n, stage in enumerate(FLOORS) if _stage(module) in stage), len(FLOORS))


def test_the_top_level_of_the_package_is_the_pipelines_stages() -> None:
    entries = {p.name.removesuffix(".py") for p in (REPO / "trtbuild").iterdir()
               if (p.suffix == ".py" or (p / "__init__.py").is_file())}
    assert entries == set().union(*FLOORS)


def test_no_module_imports_a_stage_above_its_own() -> None:
    up = sorted(f"{a} -> {b}" for a, imported in _import_graph().items() for b in imported if _floor(b) < _floor(a))
    assert not up, "imports that run back up: " + ", ".join(up)
    assert _floor("trtbuild.store.local") > _floor("trtbuild.backends.torch.backend") > _floor("trtbuild.serving.server")


def test_the_readme_is_short_and_the_depth_is_in_docs() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 300
    for link in re.findall(r"\]\((docs/[^)]+)\)", readme):
        assert (REPO / link).is_file(), link
