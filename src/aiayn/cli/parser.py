"""The parser of the `aiayn` command: argparse that suggests the closest command or flag for a
misspelt one."""

from __future__ import annotations

import argparse
import difflib
import sys
import typing
from typing import Any


class ArgumentParser(argparse.ArgumentParser):
    """argparse that suggests the closest command or flag for a misspelt one (Python 3.12's
    ``suggest_on_error``, which 3.10 and 3.11 lack) and names the subcommand whose flag it was,
    with that subcommand's usage.

    Long flags must be spelt out (``allow_abbrev=False``): a prefix that works today (``--max-step``
    for ``--max-steps``) would break the day a flag sharing it is added, and a misspelling now
    gets its suggestion instead.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self._given: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:  # reported by the subcommand that was given them, not by `aiayn`
            self._innermost(namespace).error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if isinstance(action, argparse._SubParsersAction) and value not in action.choices:
            names = list(action.choices)
            close = difflib.get_close_matches(value, names, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"choose from {', '.join(names)}"
            raise argparse.ArgumentError(None, f"unknown command {value!r}; {hint}")
        super()._check_value(action, value)

    def error(self, message: str) -> typing.NoReturn:
        super().error(message + self._suggestions())

    def _innermost(self, namespace: argparse.Namespace) -> ArgumentParser:
        """The (sub)command parser that parsed the end of the command line."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(namespace, action.dest, None))
                if isinstance(chosen, ArgumentParser):
                    return chosen._innermost(namespace)
        return self

    def _suggestions(self) -> str:
        """ "; did you mean '--max-steps'?" for the long flags given that this parser lacks."""
        if any(isinstance(a, argparse._SubParsersAction) for a in self._actions):
            return ""  # the flags belong to a subcommand, which suggests for itself
        known = [flag for flag in self._option_string_actions if flag.startswith("--")]
        pairs = []
        for token in self._given:
            if token == "--":
                break
            flag = token.partition("=")[0]
            if flag.startswith("--") and flag not in self._option_string_actions:
                close = difflib.get_close_matches(flag, known, n=1)
                if close:
                    pairs.append((close[0], flag))
        if len(pairs) == 1:
            return f"; did you mean {pairs[0][0]!r}?"
        if pairs:
            return "; did you mean " + ", ".join(f"{c!r} for {f!r}" for c, f in pairs) + "?"
        return ""
