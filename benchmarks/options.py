"""Command-line parameter types and checks the ``moecomm`` commands share.

A bad value is a one-line usage error (exit code 2) naming the option, raised before any rank
starts, never a traceback from deep inside a run or an empty table.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import click

from transports.settings import check_timeout

from .common import parse_size


class ByteSize(click.ParamType):
    """A byte count as nccl-tests writes it (``8``, ``64K``, ``1M``, ``2G``), converted to an int >= 0."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        try:
            return parse_size(value)
        except ValueError as e:
            self.fail(str(e), param, ctx)


class Seconds(click.ParamType):
    """A timeout: a positive, finite number of seconds (``transports.settings.check_timeout``)."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        try:
            return check_timeout(seconds, source="the timeout")
        except ValueError as e:
            self.fail(str(e), param, ctx)


class FiniteFloat(click.ParamType):
    """A finite number above ``min`` (or at least ``min`` with ``min_open=False``): click's FloatRange lets
    nan and inf through, which a learning rate or a time budget must not be."""

    name = "number"

    def __init__(self, min: float = 0.0, *, min_open: bool = True):
        self.min, self.min_open = min, min_open

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(number) or number < self.min or (self.min_open and number == self.min):
            self.fail(f"{value!r}: give a finite number {'>' if self.min_open else '>='} {self.min:g}", param, ctx)
        return number


class FigurePath(click.ParamType):
    """A file name whose extension matplotlib can write (``.png``, ``.pdf``, ``.svg``, ...)."""

    name = "FILE.png"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        suffix = Path(str(value)).suffix.lower().lstrip(".")
        if suffix == "png":  # the common case, without loading matplotlib
            return str(value)
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        kinds = FigureCanvasAgg.get_supported_filetypes()
        if suffix not in kinds:
            self.fail(f"{value!r}: matplotlib cannot write {'.' + suffix if suffix else 'a file without an extension'}"
                      f"; use one of {', '.join('.' + k for k in sorted(kinds))}", param, ctx)
        return str(value)


class OutputFile(click.ParamType):
    """A file the command writes at its end (its folders are created then), checked up front: not a
    directory, and writable where it is or creatable in its nearest existing folder, so that a long run
    does not fail at its last step."""

    name = "FILE"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        path = Path(str(value)).expanduser().absolute()
        if path.is_dir():
            self.fail(f"{value!r} is a directory", param, ctx)
        if path.exists():
            if not os.access(path, os.W_OK):
                self.fail(f"{value!r} is not writable", param, ctx)
            return str(value)
        folder = path.parent
        while not folder.exists():  # the folders to create: the nearest existing one must take them
            folder = folder.parent
        if not folder.is_dir():
            self.fail(f"{value!r}: {str(folder)!r} is not a directory", param, ctx)
        if not os.access(folder, os.W_OK | os.X_OK):
            self.fail(f"{value!r}: cannot create files in {str(folder)!r}", param, ctx)
        return str(value)


BYTES = ByteSize()
OUTPUT_FILE = OutputFile()
SECONDS = Seconds()
FIGURE = FigurePath()
COUNT = click.IntRange(min=1)  # ranks, iterations, tokens, sizes: at least one
NONNEGATIVE = click.IntRange(min=0)  # warmup iterations, checks, roots, seeds


def comma_list(text: str | None) -> list[str]:
    """``"a, b,,c"`` -> ``["a", "b", "c"]`` (None or blank: empty)."""
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def positive_ints(text: str | None, param_hint: str, what: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]``, in the order given; ``click.BadParameter`` (on ``param_hint``) for
    a non-int, an empty item, an empty list, or a value below 1 (named ``what``, e.g. "TP size")."""
    items = [t.strip() for t in (text or "").split(",")]
    if text and text.strip() and "" in items:  # "2,,4" or "2,4,": a typo, not a shorter list
        raise click.BadParameter(f"{text!r} has an empty item", param_hint=param_hint)
    try:
        values = [int(s) for s in comma_list(text)]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of ints", param_hint=param_hint) from None
    if not values:
        raise click.BadParameter(f"no {what} given", param_hint=param_hint)
    for v in values:
        if v < 1:
            raise click.BadParameter(f"{what} {v} must be >= 1", param_hint=param_hint)
    return values
