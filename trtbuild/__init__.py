"""trtbuild: declarative, measured, cached inference-engine builds for LLMs.

    recipe = trtbuild.load_recipe("recipes/tiny-llama.yaml")
    engine = trtbuild.build(recipe)                     # a cache hit, or a build
    with trtbuild.open(recipe, build=False) as session:  # a server restart never compiles
        ids = session.generate([[1, 2, 3]], max_new_tokens=16)
"""

from __future__ import annotations

__version__ = "0.1.0"

# Before anything imports torch: one libstdc++ for every compiled graph (trtbuild/backends/torch/cxx.py).
from trtbuild.backends.torch.cxx import make_global as _make_global  # noqa: E402

_make_global()

from trtbuild.errors import TrtbuildError  # noqa: E402
from trtbuild.recipe import Recipe, load_recipe  # noqa: E402


def build(recipe: Recipe, engines: str | None = None):  # type: ignore[no-untyped-def]
    """Look up or build the engine for `recipe`; returns a `trtbuild.builder.BuildOutcome`."""
    from trtbuild.builder import build as _build

    return _build(recipe, engines)


def open(recipe: Recipe, engines: str | None = None, build: bool = True):  # type: ignore[no-untyped-def]  # noqa: A001
    """A `trtbuild.runner.Session` context manager over the recipe's engine."""
    from trtbuild.runner import open_session

    return open_session(recipe, engines=engines, build=build)


__all__ = ["Recipe", "TrtbuildError", "build", "load_recipe", "open", "__version__"]
