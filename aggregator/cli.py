"""Argument parsing shared by the console scripts (intml-aggregator, intml-testbed, intml-sim and
``python -m intml.testbed.mroute``): a parser whose errors are one line, and the option validators they all use.
It lives with the aggregator, the lowest package with a command line, so that the simulator's and the testbed's
import it without importing upwards (tests/testbed/test_layering.py).

Every CLI checks all its options before it starts anything: a bad value ends the run with one line on stderr,
``PROG: argument --OPTION: what is wrong, and the range or form that would do (see PROG --help)``, and exit
code 2 (argparse's, without its usage block: the line names the help to read). The ranges are the code's own
limits, passed in by the caller (``MAX_WORLD``, ``max_packet_elements(codec)``, the aggregator's pool limit...),
not restated here.

The validators raise ``OptionError``, both an ``argparse.ArgumentTypeError`` (so that argparse prints its message
instead of "invalid ... value") and a ``ValueError`` (so that code outside argparse, such as a cross-option check
or the testbed's rate parser, can use them as plain functions).
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
from collections.abc import Callable
from typing import NoReturn, TypeVar

T = TypeVar("T")

INTERRUPTED = 128 + 2  # the exit code of a run stopped by Ctrl-C (SIGINT), as shells report it
PORTS = 65536  # UDP ports 0..65535
MULTICAST_FIRST = ipaddress.IPv4Address("224.0.1.0")  # 224.0.0.0/24 is the link-local control block
MULTICAST_LAST = ipaddress.IPv4Address("239.255.255.255")
RATE_UNITS = {"tbit": 10**12, "gbit": 10**9, "mbit": 10**6, "kbit": 10**3, "bit": 1}  # tc's bit-rate units


class OptionError(argparse.ArgumentTypeError, ValueError):
    """A bad option value, with a message that says what is wrong and what would do."""


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, naming the problem and where to look; its subcommands'
    parsers are OneLineParsers too (argparse gives subparsers the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def option_error(self, option: str, message: str) -> NoReturn:
        """A cross-option check's failure, worded like a type error: ``argument --OPTION: message``."""
        self.error(f"argument {option}: {message}")

    def check(self, option: str, validate: Callable[..., T], *args: object) -> T:
        """``validate(*args)`` for a check that involves other options, or its OptionError as a one-line error
        naming ``option``."""
        try:
            return validate(*args)
        except OptionError as exc:
            self.option_error(option, str(exc))


def _number(kind: type, text: str) -> int | float:
    what = "an integer" if kind is int else "a number"
    try:
        value = kind(text)
    except ValueError:
        raise OptionError(f"expected {what}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise OptionError(f"expected a finite number, got {text!r}")
    return value


def count(least: int = 1, most: int | None = None, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer from ``least`` to ``most`` (no upper limit if None); ``why`` names the limit
    (e.g. "MAX_WORLD: one 64-bit bitmap per slot") and is shown with it."""

    def parse(text: str) -> int:
        value = _number(int, text)
        if value < least or (most is not None and value > most):
            low = "> 0" if least == 1 else f"at least {least}"
            bound = low if most is None else f"{low} and at most {most}"
            raise OptionError(f"must be {bound}{f' ({why})' if why else ''}, got {text}")
        return value

    parse.__name__ = "count"
    return parse


def positive(kind: type = int, most: float | None = None, why: str = "") -> Callable[[str], float | int]:
    """An argparse type: a number of ``kind`` greater than zero (and at most ``most``, if given)."""
    if kind is int:
        return count(1, None if most is None else int(most), why)

    def parse(text: str) -> float:
        value = _number(float, text)
        if value <= 0 or (most is not None and value > most):
            bound = f"> 0 and at most {most:g}" if most is not None else "> 0"
            raise OptionError(f"must be {bound}{f' ({why})' if why else ''}, got {text}")
        return value

    parse.__name__ = "positive"
    return parse


def non_negative(text: str) -> float:
    """An argparse type: a number >= 0 (for options where 0 means "never" or "none")."""
    value = _number(float, text)
    if value < 0:
        raise OptionError(f"must be >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    """An argparse type: a probability in [0, 1), e.g. a loss rate (1 would lose everything)."""
    value = _number(float, text)
    if not 0 <= value < 1:
        raise OptionError(f"must be a fraction in [0, 1), e.g. 0.01 for 1%, got {text}")
    return value


def port(text: str) -> int:
    """An argparse type: a UDP port, 0 to 65535."""
    return count(0, PORTS - 1, "a UDP port")(text)


def multicast_group(text: str, groups: int = 1, room: str = "") -> str:
    """``text`` if it is an IPv4 multicast group with room for ``groups`` consecutive groups from it (``room``
    says what they are for), as an argparse type with the default ``groups``; raises OptionError otherwise."""
    try:
        first = ipaddress.IPv4Address(text)
    except ValueError:
        raise OptionError(f"expected an IPv4 multicast group such as 239.255.42.0, got {text!r}") from None
    last = MULTICAST_LAST - (groups - 1)
    if not MULTICAST_FIRST <= first <= last:
        raise OptionError(f"must be an IPv4 multicast group from {MULTICAST_FIRST} to {last}"
                          f"{f' (room for {groups} groups: {room})' if groups > 1 else ''}, e.g. 239.255.42.0, "
                          f"got {text}")
    return text


def bit_rate(text: str) -> int:
    """A link rate in tc's syntax ('100mbit', '1gbit', '2.5gbit', '500kbit') -> bits per second, > 0."""
    low = text.strip().lower()
    for unit, scale in RATE_UNITS.items():
        number = low[: -len(unit)]
        if low.endswith(unit) and number.replace(".", "", 1).isdigit():
            bits = int(float(number) * scale)
            if bits < 1:
                raise OptionError(f"a rate must be above 0, e.g. 100mbit, got {text!r}")
            return bits
    raise OptionError(f"a rate looks like 100mbit, 1gbit or 500kbit ({'/'.join(reversed(RATE_UNITS))}), "
                      f"got {text!r}")


def rate(text: str) -> str:
    """An argparse type: a link rate (bit_rate's syntax), kept as written (the testbed prints it)."""
    bit_rate(text)
    return text


def parsed_by(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse type from a parse function whose ValueError message reads as one line (e.g. a scenario's
    rate parser), so that argparse shows that message instead of "invalid ... value"."""

    def typed(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise OptionError(str(exc)) from None

    typed.__name__ = parse.__name__
    return typed


def output_file(text: str) -> str:
    """An argparse type: a file to write at the end of a run, checked before the run (its folder exists and is
    writable), so that a long benchmark does not end on a bad path."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise OptionError(f"{text} is a folder; name a file in it")
    if not os.path.isdir(folder):
        raise OptionError(f"folder {folder} does not exist; create it or name a file elsewhere")
    if not os.access(folder, os.W_OK):
        raise OptionError(f"cannot write to folder {folder}; name a file elsewhere")
    return text


def input_file(text: str) -> str:
    """An argparse type: a file to read, checked to exist and be readable."""
    if not os.path.isfile(text):
        raise OptionError(f"no file {text}")
    if not os.access(text, os.R_OK):
        raise OptionError(f"cannot read {text}")
    return text


def default_cores(cpus: int | None = None) -> int:
    """The default number of intml-aggregator's data-plane processes (--cores): half the CPUs this process may run
    on (each core's datagrams cost the kernel about as much CPU as the core itself), at least 1."""
    return max(1, (len(os.sched_getaffinity(0)) if cpus is None else cpus) // 2)
