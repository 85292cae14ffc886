"""The one user-facing exception type.

Anything raised as a `TrtbuildError` is the user's to fix (a recipe, a model folder, a flag, the
store) and is shown as `Error: ...` with its hint; any other exception is a bug in trtbuild and keeps
its traceback.
"""

from __future__ import annotations


class TrtbuildError(Exception):
    """An error the user can act on. `exit_code` 2 means bad input, 1 means the operation failed."""

    exit_code: int = 1

    def __init__(self, message: str, hint: str | None = None, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class InputError(TrtbuildError):
    """Bad input: a recipe, a model folder, a weight file or a flag. Exit status 2."""

    exit_code = 2


class RecipeError(InputError):
    """Every problem found in one recipe, reported together as `file: field.path: message`."""

    def __init__(self, path: str, problems: list[str]) -> None:
        self.path = path
        self.problems = problems
        lines = "\n".join(f"  {p}" for p in problems)
        super().__init__(f"{path}: {len(problems)} problem(s) in the recipe:\n{lines}")


class EngineMissingError(TrtbuildError):
    """A lookup missed while building was forbidden (`--no-build`, `TRTBUILD_NO_BUILD=1`)."""


class BackendUnavailableError(TrtbuildError):
    """The recipe's backend cannot be imported here; the hint says what to install."""


class IncompatibleEngineError(TrtbuildError):
    """A stored engine this runtime cannot load (another library version or GPU, not a plan).

    `reason` is one of version_mismatch, device_mismatch, not_a_plan, unknown. The engine is not
    broken, it was built for something else: the runner quarantines it and rebuilds when allowed.
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message, hint="rebuild the engine here (remove it with `trtbuild cache rm` and build "
                                       "again); engines only load with the library version and GPU that built them")
        self.reason = reason
