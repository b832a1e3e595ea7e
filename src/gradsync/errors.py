"""User-facing errors. The CLI prints these as one line and exits with status 2."""

from __future__ import annotations

from typing import Any


class GradsyncError(Exception):
    """A problem the user can fix; its message is complete on one line."""


class OptionError(GradsyncError, ValueError):
    """An option has a value that breaks a rule. The message names option, value, rule and fix."""

    def __init__(self, option: str, value: Any, rule: str, fix: str = "") -> None:
        self.option, self.value, self.rule, self.fix = option, value, rule, fix
        msg = f"{option}={value!r} is invalid: {rule}"
        if fix:
            msg += f" ({fix})"
        super().__init__(msg)


def check(ok: bool, option: str, value: Any, rule: str, fix: str = "") -> None:
    """Raise :class:`OptionError` unless ``ok``."""
    if not ok:
        raise OptionError(option, value, rule, fix)


#: Set to ``cli`` by the ``gradsync`` command (its launched workers inherit it): messages then spell
#: an option as the flag that sets it; otherwise as the constructor argument (plain ``L.Trainer``).
ENTRY_ENV = "GRADSYNC_ENTRY"


def spell(option: str, value: Any = None, component: str = "strategy") -> str:
    """An option as the user in front of this message sets it: ``--strategy.find_unused_parameters
    true`` under the ``gradsync`` command, ``find_unused_parameters=True`` in Python."""
    import os

    if os.environ.get(ENTRY_ENV) == "cli":
        if value is None:
            return f"--{component}.{option}"
        text = str(value).lower() if isinstance(value, bool) else str(value)
        return f"--{component}.{option} {text}"
    return option if value is None else f"{option}={value!r}"
