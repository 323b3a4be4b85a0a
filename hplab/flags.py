"""Command-line flags made from the config dataclasses, so both command lines agree.

`hplab.train` and `hplab.plan` add their layout flags with `add_flags(group, Layout)`: each
field declared with `config.option(...)` becomes `config.flag(name)` with that field's type,
choices and help, under its own name (`args.virtual_stages`). A command overrides a default
or a help text, or leaves a field out, where it means something else there. `shown` turns a
refusal's settings back into the flags the user typed, for its one-line error.
"""

from __future__ import annotations

import argparse
import dataclasses

from hplab.config import flag


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
