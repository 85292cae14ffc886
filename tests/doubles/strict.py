"""Strictness for test doubles of pybind11 modules: names come from an API-surface list, not from the fake.

A fake class is written as plain Python (the behaviour), then specialised per API flavour by
`Surface.specialise`: every public attribute, method, enum member and keyword argument is checked
against the surface list and the signature metadata extracted from the real bindings, so code that
works against the double uses only names the real module has. What the fake does not model raises
NotImplementedError (a gap in the double), never AttributeError (a name the real module lacks).

Accesses are recorded as "Class.member" / "tensorrt.name", so a test can assert that everything the
code under test touched is in the surface JSON.
"""

from __future__ import annotations

import contextlib
import json
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SURFACE_DIR = Path(__file__).resolve().parent / "trt_surface"
# Attributes every pybind11 enum has, whatever the bindings declare (pybind11's enum_base).
PYBIND_ENUM_BUILTINS = frozenset({"name", "value", "__members__"})


def tag_version(tag: str) -> tuple[int, ...]:
    return tuple(int(p) for p in tag.lstrip("v").split("."))


class Recorder:
    """The names touched through the double; the double's own internal calls are not counted."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self._quiet = 0

    def add(self, name: str) -> None:
        if not self._quiet:
            self.names.add(name)

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1


class Surface:
    """One flavour of the API: member names per class, plus signatures and kinds from the meta file."""

    def __init__(self, surface_file: str, version: tuple[int, ...], eleven: bool) -> None:
        self.members: dict[str, set[str]] = {k: set(v) for k, v in
                                             json.loads((SURFACE_DIR / surface_file).read_text()).items()}
        self.meta: dict[str, Any] = json.loads((SURFACE_DIR / "tensorrt_api_surface_meta.json").read_text())["classes"]
        self.version = version
        self.eleven = eleven

    def has(self, cls: str, name: str) -> bool:
        return name in self.members.get(cls, ())

    def is_enum(self, cls: str) -> bool:
        return self.meta.get(cls, {}).get("kind") == "enum" or (cls not in self.meta and cls[:1].isupper()
                                                                   and cls.endswith(("Form", "Kind")))

    def constructible(self, cls: str) -> bool:
        return bool(self.meta.get(cls, {}).get("constructible", False))

    def _applies(self, item: dict[str, Any]) -> bool:
        if self.eleven:
            return bool(item.get("in_11.1", True))
        return tag_version(item.get("since", "v10.0.0")) <= self.version

    def signatures(self, cls: str, name: str) -> list[list[str]] | None:
        """Argument lists of the overloads this flavour has; None where the meta gives none."""
        member = self._member(cls, name)
        sigs = [s["args"] for s in member.get("signatures", []) if "args" in s and self._applies(s)]
        return sigs or None

    def kind(self, cls: str, name: str) -> str | None:
        member = self._member(cls, name)
        kinds = [s.get("kind") for s in member.get("signatures", [])]
        return kinds[0] if kinds else member.get("kind")

    def enum_values(self, cls: str) -> dict[str, int]:
        members = self.meta.get(cls, {}).get("members", {})
        names = sorted(n for n in self.members.get(cls, ()) if not n.startswith("_") and n != "itemsize")
        return {n: members.get(n, {}).get("int_value", i) for i, n in enumerate(names)}

    def _member(self, cls: str, name: str) -> dict[str, Any]:
        entry = self.meta.get(cls, {})
        member = entry.get("members", {}).get(name)
        if member is None:  # inherited members are flattened in the lists, not always in the meta
            for base in entry.get("bases", []):
                member = self.meta.get(base, {}).get("members", {}).get(name)
                if member is not None:
                    break
        return member or {}


def check_call(qual: str, sigs: list[list[str]] | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise TypeError, as pybind11 does, unless some overload accepts these arguments by name and count."""
    if sigs is None:
        return
    for sig in sigs:
        if not sig:  # no names bound: positional-only (or no parameters; the implementation checks the count)
            if not kwargs:
                return
            continue
        names = [a.split("=", 1)[0] for a in sig]
        required = [a.split("=", 1)[0] for a in sig if "=" not in a]
        if len(args) > len(names) or any(k not in names[len(args):] for k in kwargs):
            continue
        if all(n in names[:len(args)] or n in kwargs for n in required):
            return
    shown = "\n".join(f"    {i + 1}. ({', '.join(s)})" for i, s in enumerate(sigs))
    raise TypeError(f"{qual}(): incompatible function arguments. The following argument types are supported:\n"
                    f"{shown}\n\nInvoked with: args={args!r}, kwargs={sorted(kwargs)!r}")


def _is_user_class(k: type) -> bool:
    return not ({"_fake_generated", "_fake_impl"} & set(vars(k))) and k not in (object, bytes, StrictBase)


def _defining_class(cls: type, name: str) -> type | None:
    for k in cls.__mro__:
        if name in vars(k):
            return k
    return None


class StrictMeta(type):
    """Class-level strictness: `trt.BuilderFlag.FP16`, `trt.Logger.WARNING`, constructors."""

    def __getattribute__(cls, name: str) -> Any:
        if name.startswith("_") and (name.startswith("_fake") or name.startswith("__")):
            return type.__getattribute__(cls, name)
        try:
            surface: Surface = type.__getattribute__(cls, "_fake_surface")
        except AttributeError:  # a behaviour class, not yet specialised to a flavour
            return type.__getattribute__(cls, name)
        owner = _defining_class(cls, name)
        if owner is not None and _is_user_class(owner):
            return type.__getattribute__(cls, name)
        fake_name = cls._fake_name
        if not surface.has(fake_name, name):
            raise AttributeError(f"type object 'tensorrt.tensorrt.{fake_name}' has no attribute '{name}'")
        cls._fake_recorder.add(f"{fake_name}.{name}")
        try:
            return type.__getattribute__(cls, name)
        except AttributeError:
            raise NotImplementedError(f"the TensorRT double does not model {fake_name}.{name}") from None

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if "_fake_generated" in vars(cls):
            fake_name = cls._fake_name
            if not cls._fake_surface.constructible(fake_name) and not cls._fake_surface.is_enum(fake_name):
                raise TypeError(f"tensorrt.tensorrt.{fake_name}: No constructor defined!")
            check_call(f"{fake_name}.__init__", cls._fake_surface.signatures(fake_name, "__init__"), args, kwargs)
        return type.__call__(cls, *args, **kwargs)


class StrictBase(metaclass=StrictMeta):
    """Instance-level strictness. State of the double lives in attributes named `_fake_*`."""

    _fake_impl = True

    @classmethod
    def _fake_new(cls, *args: Any, **kwargs: Any) -> Any:
        """Create an instance the way the library does internally (no public constructor needed)."""
        obj = cls.__new__(cls) if not issubclass(cls, bytes) else bytes.__new__(cls, *args)
        obj._fake_init(*args, **kwargs)
        return obj

    def _fake_init(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("__") or name.startswith("_fake"):
            return object.__getattribute__(self, name)
        cls = type(self)
        inst = object.__getattribute__(self, "__dict__") if hasattr(self, "__dict__") else {}
        owner = _defining_class(cls, name)
        if (owner is not None and _is_user_class(owner)) or (name in inst and any(_is_user_class(k) for k in cls.__mro__)):
            return object.__getattribute__(self, name)
        fake_name = cls._fake_name
        surface: Surface = cls._fake_surface
        if not surface.has(fake_name, name):
            raise AttributeError(f"'tensorrt.tensorrt.{fake_name}' object has no attribute '{name}'")
        cls._fake_recorder.add(f"{fake_name}.{name}")
        if surface.kind(fake_name, name) == "writeonly_property":
            raise AttributeError(f"unreadable attribute '{name}'")
        try:
            value = object.__getattribute__(self, name)
        except AttributeError:
            raise NotImplementedError(f"the TensorRT double does not model {fake_name}.{name}") from None
        if isinstance(value, types.MethodType):
            sigs = surface.signatures(fake_name, name)

            def checked(*args: Any, **kwargs: Any) -> Any:
                check_call(f"{fake_name}.{name}", sigs, args, kwargs)
                return value(*args, **kwargs)

            return checked
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_fake"):
            object.__setattr__(self, name, value)
            return
        cls = type(self)
        fake_name = cls._fake_name
        surface: Surface = cls._fake_surface
        if not surface.has(fake_name, name):
            if any(_is_user_class(k) for k in cls.__mro__):
                object.__setattr__(self, name, value)  # a Python subclass (a custom ILogger) has a __dict__
                return
            raise AttributeError(f"'tensorrt.tensorrt.{fake_name}' object has no attribute '{name}'")
        if surface.kind(fake_name, name) in ("readonly_property", "method", "static_readonly_property"):
            raise AttributeError(f"can't set attribute '{name}' of 'tensorrt.tensorrt.{fake_name}'")
        cls._fake_recorder.add(f"{fake_name}.{name}")
        object.__setattr__(self, name, value)


class FakeEnum(StrictBase):
    """A pybind11 enum value: hashable, int()-able, compares equal only to values of its own enum."""

    def _fake_init(self, name: str, value: int) -> None:
        self._fake_member = name
        self._fake_value = value

    @property
    def name(self) -> str:
        return self._fake_member

    @property
    def value(self) -> int:
        return self._fake_value

    def __getattribute__(self, name: str) -> Any:
        if name in PYBIND_ENUM_BUILTINS:
            return object.__getattribute__(self, name)
        return super().__getattribute__(name)

    def __int__(self) -> int:
        return self._fake_value

    __index__ = __int__

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._fake_value == self._fake_value  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self)._fake_name, self._fake_value))

    def __or__(self, other: Any) -> int:
        return int(self) | int(other)

    def __and__(self, other: Any) -> int:
        return int(self) & int(other)

    def __repr__(self) -> str:
        return f"<{type(self)._fake_name}.{self._fake_member}: {self._fake_value}>"

    def __str__(self) -> str:
        return f"{type(self)._fake_name}.{self._fake_member}"
