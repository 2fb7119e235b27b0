"""The command line's parser: argparse, with its usage errors as deltaship's own (one line of what went wrong, naming
the subcommand, and one of the fix, exit 2) and a did-you-mean for a misspelt option, choice or command.

Python 3.11's argparse has no `suggest_on_error` (3.14 has); this is the same, with difflib, for every subcommand:
every parser the CLI builds is a `Parser` (add_subparsers makes its subparsers of the parent's class).
"""

from __future__ import annotations

import argparse
import difflib
import re
from typing import NoReturn

from deltaship.errors import EXIT_BAD_INPUT

# argparse's messages, as 3.11 words them
_CHOICE = re.compile(r"argument (?P<arg>[^:]+): invalid choice: '(?P<word>.*)' \(choose from (?P<choices>.*)\)$")
_FIX = "; fix: "  # an option's type= check puts its fix after this (deltaship/cli.py's _arg)


def suggestion(word: str, candidates: list[str]) -> str | None:
    """The candidate closest to `word`, if one is close (difflib's ratio >= 0.6)."""
    close = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
    return close[0] if close else None


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line plus a fix line, with a suggestion where there is one."""

    def fail(self, what: str, fix: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {what}\n  fix: {fix}\n")

    def error(self, message: str) -> NoReturn:
        m = _CHOICE.match(message)
        if m:
            word, choices = m["word"], [c.strip().strip("'") for c in m["choices"].split(",")]
            if m["arg"] == "command":  # the subcommand itself: `deltaship exprot`
                near = suggestion(word, choices)
                self.fail(
                    f"unknown command {word!r}" + (f"; did you mean {near!r}?" if near else ""),
                    f"use deltaship {near} (deltaship --help lists the commands)"
                    if near
                    else f"use one of: {', '.join(choices)} (deltaship --help)",
                )
            arg = m["arg"].split("/")[-1]  # "-p/--precision": the long name
            near = suggestion(word, choices)
            self.fail(
                f"{arg} {word} is not one of {', '.join(choices)}" + (f"; did you mean {near}?" if near else ""),
                f"pass {arg} {near or choices[0]}" + ("" if near else f" (or another of {', '.join(choices)})"),
            )
        what, _, fix = message.partition(_FIX)
        self.fail(what, fix or f"`{self.prog} --help` shows what each option takes")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        """As argparse's, with an unknown option named with the option it is closest to, in the subcommand's parser
        (argparse reports those in the top parser, without saying which subcommand did not know it)."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._subcommand(ns) or self
            parser.unknown(extras)
        return ns

    def _subcommand(self, ns: argparse.Namespace) -> Parser | None:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(ns, action.dest, None) or "")
                return chosen if isinstance(chosen, Parser) else None
        return None

    def unknown(self, extras: list[str]) -> NoReturn:
        options = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        flags = [x for x in extras if x.startswith("-") and len(x) > 1]
        if not flags:
            self.fail(
                f"unexpected argument{'s' if len(extras) > 1 else ''} {' '.join(extras)}",
                f"drop {'them' if len(extras) > 1 else 'it'}, or quote a value that has spaces "
                f"(`{self.prog} --help` shows the arguments)",
            )
        word = flags[0].split("=", 1)[0]
        near = suggestion(word, options)
        self.fail(
            f"unknown option {word}" + (f"; did you mean {near}?" if near else ""),
            f"pass {near} instead of {word}" if near else f"`{self.prog} --help` lists its options",
        )
