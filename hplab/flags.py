"""Command-line flags made from the config dataclasses, so both command lines agree.

`hplab.train` and `hplab.plan` add their layout flags with `add_flags(group, Layout)`: each
field declared with `option(...)` (config.py) becomes `flag(name)` with that field's type,
choices and help, under its own name (`args.virtual_stages`). A command overrides a default
or a help text, or leaves a field out, where it means something else there. `shown` turns a
refusal's settings back into the flags the user typed, for its one-line error.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import field

FLAG_NAMES = {"n_positions": "--seq-len", "n_experts": "--moe-experts"}


def flag(name: str) -> str:
    """The command-line flag of a field: `virtual_stages` → `--virtual-stages`."""
    return FLAG_NAMES.get(name, "--" + name.replace("_", "-"))


def at_least(low: float, kind=int, above: bool = False):
    """An argparse type: a number of `kind` that is at least `low` (`above`: more than `low`)."""

    def parse(text: str):
        value = kind(text)
        if not (value > low if above else value >= low):  # (NaN fails both)
            wanted = "a positive number" if above else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {wanted}, got {text}")
        if value == math.inf:
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        return value

    parse.__name__ = "positive_float" if above else kind.__name__  # "invalid int value"
    return parse


COUNT = at_least(1)
NONNEGATIVE = at_least(0, float)


def SEED(text: str) -> int:  # noqa: N802 (an argparse type, named like COUNT)
    """An argparse type: a seed torch takes, from 0 to 2**63 - 1."""
    value = int(text)
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be from 0 to 2**63 - 1, got {text}")
    return value


SEED.__name__ = "int"  # ("invalid int value" for a word)


def option(default, help: str = "", **argparse_kwargs):
    """A dataclass field that is also a command-line flag (argparse's keyword arguments)."""
    return field(default=default, metadata=dict(help=help, **argparse_kwargs))


def add_flags(group, cls, defaults: dict | None = None, skip=(), helps: dict | None = None):
    """One flag per `option` field of the dataclass `cls`, into an argparse `group`; `defaults`
    and `helps` override a field's default and help for this command, `skip` leaves fields out."""
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        kwargs = {**f.metadata, "dest": f.name}
        kwargs["default"] = (defaults or {}).get(f.name, f.default)
        kwargs["help"] = (helps or {}).get(f.name, f.metadata["help"])
        if f.type in (bool, "bool"):
            kwargs["action"] = "store_true"
        group.add_argument(flag(f.name), **kwargs)


def shown(settings, values: dict, defaults: dict) -> str:
    """The flags behind `settings` as the user gave them, those that differ from `defaults`:
    ("zero", "pp") → `--zero 3 --pp 2`."""
    typed = [name for name in settings if values.get(name) != defaults.get(name)]
    return " ".join(
        flag(name) if values[name] is True else f"{flag(name)} {values[name]}" for name in typed
    )


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line (a ValueError) instead of usage text."""

    def error(self, message):
        raise ValueError(f"{message} (see --help)")
