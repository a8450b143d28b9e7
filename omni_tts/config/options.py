"""Settings as command-line options: a settings dataclass states each field's default and help once (`setting`),
its bounds in its type (msgspec.Meta, as the request schemas and the stage config state theirs), and the CLI's
options are made from it (`add_options`), read back into it (`from_options`) and checked against it
(`check_bounds`), so no default or bound is written twice.

    @dataclass(kw_only=True)
    class Listener:
        backlog: Annotated[int, msgspec.Meta(ge=1)] = setting(128, "connections waiting to be accepted")

    add_options(parser, Listener)                      # --backlog BACKLOG  connections … (default: 128)
    listener = from_options(Listener, parser.parse_args())
    check_bounds(listener)                             # ValueError: --backlog must be >= 1, got 0
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, TypeVar

import msgspec

_OPTION = "option"
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Option:
    """How one settings field is a command-line option."""
    help: str
    flag: str | None = None        # default: --field-name
    argparse: dict[str, Any] = dataclasses.field(default_factory=dict)   # more add_argument keywords


def setting(default: Any, help: str, *, flag: str | None = None, **argparse_kwargs: Any) -> Any:
    """A settings field that is also a command-line option: its default and help. A bool field is a switch (its
    flag sets True; one that defaults to True is turned off by its flag, `--no-…`)."""
    return dataclasses.field(default=default, metadata={_OPTION: Option(help, flag, argparse_kwargs)})


def _options(settings: type) -> list[tuple[dataclasses.Field, Option, Any]]:
    """The option fields of `settings`, each with its option and its type (Annotated, with its bounds)."""
    hints = typing.get_type_hints(settings, include_extras=True)
    return [(f, f.metadata[_OPTION], hints[f.name]) for f in dataclasses.fields(settings) if _OPTION in f.metadata]


def _flag(f: dataclasses.Field, option: Option) -> str:
    return option.flag or "--" + f.name.replace("_", "-")


def _base(hint: Any) -> Any:
    """int of Annotated[int, …], str of str | None, str of tuple[str, ...]."""
    if typing.get_origin(hint) is typing.Annotated:
        return _base(typing.get_args(hint)[0])
    args = [a for a in typing.get_args(hint) if a is not type(None) and a is not Ellipsis]
    return _base(args[0]) if args else hint


def add_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, settings: type) -> None:
    """One option per `setting` field of `settings`, in field order; the value lands in the field's name."""
    for f, option, hint in _options(settings):
        flag = _flag(f, option)
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": option.help}
        base = _base(hint)
        if base is bool:
            kwargs["action"] = "store_false" if f.default else "store_true"
        else:
            kwargs["metavar"] = flag.lstrip("-").replace("-", "_").upper()
            if base in (int, float):
                kwargs["type"] = base
        parser.add_argument(flag, **{**kwargs, **option.argparse})


def from_options(settings: type[T], args: argparse.Namespace, **others: Any) -> T:
    """`settings` built from the options `add_options` made (a list option as a tuple) and `others`, its other
    fields."""
    values = {f.name: getattr(args, f.name) for f, _, _ in _options(settings)}
    return settings(**{name: tuple(v) if isinstance(v, list) else v for name, v in values.items()}, **others)


def check_bounds(settings: object) -> None:
    """ValueError naming the option of the first field outside the bounds its type states."""
    for f, option, hint in _options(type(settings)):
        value = getattr(settings, f.name)
        metas = [m for m in getattr(hint, "__metadata__", ()) if isinstance(m, msgspec.Meta)]
        if value is None or not metas:
            continue
        low, high, above = metas[0].ge, metas[0].le, metas[0].gt
        if (low is not None and value < low) or (high is not None and value > high) or \
                (above is not None and not value > above):
            bounds = (f"in {low}..{high}" if low is not None and high is not None else f">= {low}" if low is not None
                      else f"> {above}" if above is not None else f"<= {high}")
            raise ValueError(f"{_flag(f, option)} must be {bounds}, got {value}")


def port_number(value: str) -> int:
    """argparse type of a TCP port option: 0..65535 (0: any free port), else a usage error."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..65535, got {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {port}")
    return port
