"""argparse types of the commands' flags: a value that makes no sense (a count of 0, a
prompt that is not UTF-8) is refused while the command line is parsed, exit 2, with a line
naming the flag, the value and what is expected, before anything runs."""

from __future__ import annotations

import argparse
import os


def positive_ints(text: str) -> tuple[int, ...]:
    """Comma-separated counts (token counts T, say): each an integer >= 1."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected comma-separated integers >= 1 (e.g. 16,256)"
        )
    return values


def utf8_text(text: str) -> str:
    """Text as typed, refused when its bytes are not UTF-8: Python keeps such bytes as lone
    surrogates (PEP 383), which no tokenizer, file or terminal can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raw = os.fsencode(text)  # the bytes as given on the command line
        raise argparse.ArgumentTypeError(
            f"{raw!r} is not UTF-8: expected UTF-8 text (re-encode it, e.g. iconv -t UTF-8)"
        ) from None
    return text


def port(text: str) -> int:
    """A TCP port: an integer in 1..65535."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a port number in 1..65535")
    return value


def float_in(low: float, high: float, low_open: bool, expected: str):
    """An argparse type for a float in [low, high] ((low, high] when low_open); NaN and
    values outside refused with `expected` in the message."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        inside = (low < value if low_open else low <= value) and value <= high
        if not inside:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {expected}")
        return value

    return parse


def int_at_least(low: int):
    """An argparse type for an integer >= low."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {low}")
        return value

    return parse


positive_int = int_at_least(1)  # a count of things
