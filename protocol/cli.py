"""Argument parsing shared by the console scripts: one-line errors and positive-number options."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, naming the problem and where to look."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def positive(kind: type = int, most: float | None = None) -> Callable[[str], float | int]:
    """An argparse type accepting numbers of `kind` greater than zero (and at most `most`, if given)."""
    what = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        if most is not None and value > most:
            raise argparse.ArgumentTypeError(f"must be at most {most}, got {text}")
        return value

    return parse
