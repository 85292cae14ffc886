"""trtbuild: declarative, measured, cached inference-engine builds for LLMs.

    import trtbuild
    with trtbuild.open("recipes/tiny-llama.yaml") as session:   # builds if needed, then loads
        completions = session.generate(["Once upon a time"], max_tokens=16)   # list[generate.Completion]
        ids = session.greedy([[1, 2, 3]], max_tokens=16)                      # the timed form: list[list[int]]

`open` takes a recipe file, a `Recipe`, or a mapping with a recipe's fields; `build=False` makes a
missing engine an error instead of a build (a server restart never compiles).
"""

from __future__ import annotations

from trtbuild.version import __version__  # noqa: E402

# Before anything imports torch: one libstdc++ for every compiled graph (trtbuild/backends/torch/cxx.py).
from trtbuild.backends.torch.cxx import make_global as _make_global  # noqa: E402

_make_global()

import os  # noqa: E402
from collections.abc import Callable, Mapping  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

from trtbuild.errors import TrtbuildError  # noqa: E402
from trtbuild.recipe import Recipe, load_recipe, parse_recipe  # noqa: E402

if TYPE_CHECKING:
    from trtbuild.builder import BuildOutcome
    from trtbuild.runner import Session


def as_recipe(recipe: str | os.PathLike[str] | Recipe | Mapping[str, Any]) -> Recipe:
    """A `Recipe` from a recipe file's path, a `Recipe`, or a mapping of a recipe's fields (validated the
    same way as a file; relative model paths are taken from the working directory)."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, Mapping):
        return parse_recipe(dict(recipe), Path("<mapping>").absolute())
    return load_recipe(recipe)


def build(recipe: str | os.PathLike[str] | Recipe | Mapping[str, Any], engines: str | None = None, *,
          progress: Callable[[str], None] | None = None) -> "BuildOutcome":
    """Look up or build the engine for `recipe` (a path, `Recipe` or mapping); returns a
    `trtbuild.builder.BuildOutcome`. `progress` receives one line per build phase."""
    from trtbuild.builder import build as _build

    return _build(as_recipe(recipe), engines, progress=progress or (lambda message: None))


def open(recipe: str | os.PathLike[str] | Recipe | Mapping[str, Any], engines: str | None = None,  # noqa: A001
         build: bool = True, progress: Callable[[str], None] | None = None) -> "Session":
    """The engine for `recipe` (a path, `Recipe` or mapping), found or built in one lookup, as a
    `trtbuild.runner.Session` to use in a `with` block. `build=False`: a missing engine is an error."""
    from trtbuild.runner import open_session

    return open_session(as_recipe(recipe), engines=engines, build=build, progress=progress or (lambda message: None))


__all__ = ["Recipe", "TrtbuildError", "as_recipe", "build", "load_recipe", "open", "parse_recipe", "__version__"]
