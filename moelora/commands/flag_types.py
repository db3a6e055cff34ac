"""argparse types of the commands' flags: a value that makes no sense (a count of 0, a
prompt that is not UTF-8) is refused while the command line is parsed, exit 2, with a line
naming the flag, the value and what is expected, before anything runs."""

from __future__ import annotations

import argparse
import os


def positive_int(text: str) -> int:
    """A count of things: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return value


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
