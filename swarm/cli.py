"""Command-line flags derived from frozen config dataclasses, so a default is written once (on the field).
A field declared with ``option(default, help=...)`` becomes ``--field-name`` (or the ``name`` given): a bool
defaulting to False becomes a switch, one defaulting to True a ``--no-...`` switch, a tuple takes one or more
values (a repeated flag adds to them), anything else is parsed by ``parse`` or by its annotated type (int, float,
str, Path, or one of them or None). A nested config field (a dataclass without a flag) contributes its own flags.
``from_args`` builds the config back from the parsed namespace; flags not given keep the field's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, overload

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")
D = TypeVar("D", bound="DataclassInstance")
Parse = Callable[[str], object]


@dataclass(frozen=True)
class Flag:
    help: str
    name: str | None = None  # default: --field-name (--no-field-name for a bool that defaults to True)
    parse: Parse | None = None  # text -> field value (default: by the field's type)
    show: str | None = None  # the default as --help shows it (default: the field's default)
    metavar: str | None = None
    hidden: bool = False  # testing aids: accepted but not listed


@overload
def option(
    default: T,
    *,
    help: str,
    name: str | None = None,
    parse: Parse | None = None,
    show: str | None = None,
    metavar: str | None = None,
    hidden: bool = False,
) -> T: ...
@overload
def option(
    *,
    factory: Callable[[], T],
    help: str,
    name: str | None = None,
    parse: Parse | None = None,
    show: str | None = None,
    metavar: str | None = None,
    hidden: bool = False,
) -> T: ...
def option(
    default: object = dataclasses.MISSING,
    *,
    factory: Callable[[], object] | None = None,
    help: str,
    name: str | None = None,
    parse: Parse | None = None,
    show: str | None = None,
    metavar: str | None = None,
    hidden: bool = False,
) -> object:
    """A dataclass field that is also a command-line flag (see the module docstring)."""
    metadata = {"flag": Flag(help, name, parse, show, metavar, hidden)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def _dest(cls: type, name: str) -> str:
    return f"{cls.__name__}.{name}"


_SCALARS: dict[object, Parse] = {int: int, float: float, str: str, Path: Path}


def _scalar(hint: object) -> Parse:
    """int, float, str or Path, also inside ``X | None``."""
    if hint in _SCALARS:
        return _SCALARS[hint]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1 and inner[0] in _SCALARS:
            return _SCALARS[inner[0]]
    raise TypeError(f"no parser for a flag of type {hint!r}: give Flag.parse")


def _explained(parse: Parse) -> Parse:
    """argparse shows an ``ArgumentTypeError``'s own message (for other errors only "invalid ... value")."""

    def run(text: str) -> object:
        try:
            return parse(text)
        except (TypeError, ValueError) as e:
            raise argparse.ArgumentTypeError(str(e) or f"invalid value {text!r}") from None

    return run


def _nested(hint: object) -> type[DataclassInstance] | None:
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def add_flags(parser: argparse.ArgumentParser, cls: type[DataclassInstance]) -> None:
    """Add a flag for every ``option`` field of the dataclass ``cls`` and of the configs nested in it."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = f.metadata.get("flag")
        hint = hints[f.name]
        if not isinstance(flag, Flag):
            nested = _nested(hint)
            if nested is not None:
                add_flags(parser, nested)
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = flag.show if flag.show is not None else ("none" if default in (None, ()) else str(default))
        text = flag.help if "(default" in flag.help else f"{flag.help} (default: {shown})"
        dest, help_text = _dest(cls, f.name), argparse.SUPPRESS if flag.hidden else text
        if hint is bool:
            name = flag.name or ("--no-" if default else "--") + f.name.replace("_", "-")
            parser.add_argument(
                name,
                dest=dest,
                default=argparse.SUPPRESS,
                help=argparse.SUPPRESS if flag.hidden else flag.help,
                action="store_false" if default else "store_true",
            )
            continue
        name = flag.name or "--" + f.name.replace("_", "-")
        metavar = flag.metavar or f.name.split("_")[-1].upper()
        if typing.get_origin(hint) is tuple:
            parse = flag.parse or _scalar(typing.get_args(hint)[0])
            parser.add_argument(
                name,
                dest=dest,
                default=argparse.SUPPRESS,
                help=help_text,
                metavar=metavar,
                nargs="+",
                action="extend",
                type=_explained(parse),
            )  # repeats add up
        else:
            parser.add_argument(
                name,
                dest=dest,
                default=argparse.SUPPRESS,
                help=help_text,
                metavar=metavar,
                type=_explained(flag.parse or _scalar(hint)),
            )


def from_args(cls: type[D], args: argparse.Namespace) -> D:
    """An instance of ``cls`` from the flags ``add_flags`` declared; flags not given keep the field's default."""
    hints = typing.get_type_hints(cls)
    values: dict[str, object] = {}
    given = vars(args)
    for f in dataclasses.fields(cls):
        nested = _nested(hints[f.name])
        if isinstance(f.metadata.get("flag"), Flag):
            if _dest(cls, f.name) in given:
                value = given[_dest(cls, f.name)]
                values[f.name] = tuple(value) if isinstance(value, list) else value
        elif nested is not None:
            values[f.name] = from_args(nested, args)
    return cls(**values)
