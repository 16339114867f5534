"""The API reference cannot drift from the code: every public name of ``ds``, ``ds.experimental``,
``ds.callbacks`` and ``ds.metrics`` (and of the public modules they hold: ``ds.cluster_resolver``,
``ds.coordinator``, ``ds.partitioners``, ``ds.testing``) has a docstring; a callable that takes arguments
names each of them in its ``Args:`` section (Google style, as mkdocs.yml's ``docstring_style`` renders it);
one annotated to return something other than None has a ``Returns:`` (or ``Yields:``) section; one whose
own body raises ``ValueError`` or ``TypeError`` for a wrong argument names it under ``Raises:``. A class's
constructor arguments are documented in the class docstring or its ``__init__``'s (``Attributes:`` for a
dataclass's fields), and its public methods and properties too. The checker itself is tested on planted
functions: one documented, some not."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import re
import textwrap
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import distrib as ds

SECTION = re.compile(r"^(\w[\w ]*):\s*$")
ENTRY = re.compile(r"^(\*{0,2}\w+)\s*(?:\(.*\))?\s*:")
OWN_RAISE = re.compile(r"^\s+raise (ValueError|TypeError)\(", re.M)
ARG_SECTIONS = ("Args", "Arguments", "Parameters", "Attributes")


def sections(doc: str) -> dict[str, list[str]]:
    """A Google-style docstring's sections: each title (``Args``) -> the lines of its body, dedented."""
    found: dict[str, list[str]] = {}
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        match = SECTION.match(line)
        if match is None or i + 1 >= len(lines) or not lines[i + 1].startswith((" ", "\t")):
            continue
        body = []
        for following in lines[i + 1 :]:
            if following.strip() and not following.startswith((" ", "\t")):
                break
            body.append(following)
        found[match.group(1)] = textwrap.dedent("\n".join(body)).splitlines()
    return found


def documented_names(doc: str) -> set[str]:
    """The names an ``Args:`` (or ``Attributes:``) section documents: ``name:`` or ``name (type):`` lines."""
    names = set()
    for title, body in sections(doc).items():
        if title in ARG_SECTIONS:
            names |= {m.group(1).lstrip("*") for line in body if (m := ENTRY.match(line))}
    return names


def parameters(function: Callable[..., Any]) -> tuple[list[str], Any]:
    """The named parameters (no ``self``/``cls``, no ``*args``/``**kwargs``) and the return annotation."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return [], inspect.Signature.empty
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    names = [p.name for p in signature.parameters.values() if p.name not in ("self", "cls") and p.kind not in variadic]
    return names, signature.return_annotation


def returns_something(annotation: Any) -> bool:
    return annotation not in (inspect.Signature.empty, None, "None", type(None), "NoReturn")


def own_raises(function: Callable[..., Any]) -> set[str]:
    """``ValueError`` / ``TypeError`` that the function's own body raises (not what it calls)."""
    try:
        return set(OWN_RAISE.findall(inspect.getsource(function)))
    except (OSError, TypeError):
        return set()


def check_callable(name: str, function: Callable[..., Any], doc: str | None = None, extra_doc: str = "") -> list[str]:
    """What ``function``'s docstring (``doc``, else its own; plus ``extra_doc``) lacks."""
    doc = (inspect.getdoc(function) if doc is None else doc) or ""
    if not doc.strip() and not extra_doc.strip():
        return [f"{name}: no docstring"]
    whole = doc + "\n\n" + extra_doc
    problems = []
    params, annotation = parameters(function)
    missing = [p for p in params if p not in documented_names(whole)]
    if missing:
        problems.append(f"{name}: Args: does not name {missing}")
    found = sections(whole)
    if returns_something(annotation) and not any(title in found for title in ("Returns", "Yields")):
        problems.append(f"{name}: no Returns: section (annotated -> {annotation})")
    raised = own_raises(function)
    if raised and not all(any(exc in line for line in found.get("Raises", [])) for exc in raised):
        problems.append(f"{name}: raises {sorted(raised)} but Raises: does not name each")
    return problems


def check_class(name: str, cls: type) -> list[str]:
    problems = [] if (inspect.getdoc(cls) or "").strip() else [f"{name}: no docstring"]
    init = cls.__dict__.get("__init__")
    if init is not None and not issubclass(cls, enum.Enum):
        init_doc = init.__doc__ if init.__doc__ else ""
        problems += [
            p.replace(".__init__: no Returns", ": no Returns")
            for p in check_callable(
                f"{name}.__init__", init, doc=inspect.cleandoc(init_doc), extra_doc=inspect.getdoc(cls) or ""
            )
        ]
    for attribute, member in vars(cls).items():
        if attribute.startswith("_"):
            continue
        if isinstance(member, property):
            if not (member.__doc__ or "").strip():
                problems.append(f"{name}.{attribute}: no docstring")
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if inspect.isfunction(member):
            # an override without a docstring shows (and is checked against) the one it overrides
            problems += check_callable(f"{name}.{attribute}", member, doc=inspect.getdoc(getattr(cls, attribute)))
    return problems


def public_names() -> Iterator[tuple[str, Any]]:
    """Every public name: ``ds.X``, and ``ds.M.X`` for each public module ``M`` of ``ds`` (by its ``__all__``)."""
    for name in ds.__all__:
        value = getattr(ds, name)
        yield f"ds.{name}", value
        if isinstance(value, types.ModuleType):
            for inner in getattr(value, "__all__", ()):
                yield f"ds.{name}.{inner}", getattr(value, inner)


def check(name: str, value: Any) -> list[str]:
    if isinstance(value, types.ModuleType):
        return [] if (value.__doc__ or "").strip() else [f"{name}: no module docstring"]
    if inspect.isclass(value):
        return check_class(name, value)
    if callable(value):
        return check_callable(name, value)
    return []  # a constant (DEFAULT_HEARTBEAT_TIMEOUT): documented where it is defined


PUBLIC = sorted(dict(public_names()).items())


def test_the_walk_finds_the_public_api():
    names = {name for name, _ in PUBLIC}
    assert {"ds.ShardedStrategy", "ds.fit", "ds.callbacks.ModelCheckpoint", "ds.metrics.Mean"} <= names
    assert {"ds.experimental.PreemptionCheckpointHandler", "ds.cluster_resolver.TFConfigClusterResolver"} <= names
    assert len(names) > 100, len(names)


@pytest.mark.parametrize("name", [name for name, _ in PUBLIC])
def test_every_public_name_documents_its_arguments_returns_and_raises(name):
    problems = check(name, dict(PUBLIC)[name])
    assert not problems, "\n".join(problems)


# --------------------------------------------------------------------------- the checker, on planted names


def documented(batch: list[int], scale: float = 1.0) -> float:
    """Scale the sum of a batch.

    Args:
        batch: the numbers.
        scale (float): what the sum is multiplied by.

    Returns:
        ``scale * sum(batch)``.

    Raises:
        ValueError: ``batch`` is empty.
    """
    if not batch:
        raise ValueError("documented(batch=[]): give at least one number")
    return scale * sum(batch)


def undocumented(batch: list[int], scale: float = 1.0) -> float:
    if not batch:
        raise ValueError("undocumented(batch=[]): give at least one number")
    return scale * sum(batch)


def half_documented(batch: list[int], scale: float = 1.0, *args: Any, **kwargs: Any) -> float:
    """Scale the sum of a batch.

    Args:
        batch: the numbers.
    """
    if not batch:
        raise ValueError("half_documented(batch=[]): give at least one number")
    return scale * sum(batch)


@dataclasses.dataclass(frozen=True)
class PlantedOptions:
    """Options.

    Attributes:
        size: how many.
    """

    size: int
    name: str = ""

    def scaled(self, factor: int) -> int:
        """``size * factor``."""
        return self.size * factor


def test_the_checker_passes_a_documented_function():
    assert check("documented", documented) == []


def test_the_checker_fails_an_undocumented_function():
    assert check("undocumented", undocumented) == ["undocumented: no docstring"]


def test_the_checker_names_each_missing_part():
    assert check("half_documented", half_documented) == [
        "half_documented: Args: does not name ['scale']",  # *args and **kwargs need no entry
        "half_documented: no Returns: section (annotated -> float)",
        "half_documented: raises ['ValueError'] but Raises: does not name each",
    ]


def test_the_checker_reads_a_classes_fields_and_methods():
    assert check("PlantedOptions", PlantedOptions) == [
        "PlantedOptions.__init__: Args: does not name ['name']",
        "PlantedOptions.scaled: Args: does not name ['factor']",
        "PlantedOptions.scaled: no Returns: section (annotated -> int)",
    ]
