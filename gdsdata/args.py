"""Checks of the arguments users pass (Loader, transforms, pack, dataset indices): one clear line
for a wrong type or a value out of range, the same test everywhere."""

import os
import re
from fractions import Fraction
from urllib.parse import unquote, urlparse

import numpy as np


def is_integer(value) -> bool:
    """A Python or numpy integer, not a bool (``True`` is an ``int`` to Python, never a count here)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def count(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int, checked: TypeError for a float, a string or a bool, ValueError below
    ``minimum``."""
    if not is_integer(value):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return int(value)


def given_path(name: str, value):
    """``value`` (a path, os.PathLike, or anything else a caller resolves itself) as it is, unless it
    is an empty string: ValueError, rather than the current folder that ``os.path`` makes of it (a
    shell variable left unset, ``gdsdata pack "$SRC" "$OUT"``, would pack or write there)."""
    if isinstance(value, (str, bytes)) and not value:
        raise ValueError(f"{name} is an empty path (a variable left unset?); name the folder, \".\" for the current "
                         "one")
    return value


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_FOLDED = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:/")  # a URL made a pathlib path: "s3:/bucket/ds" (not "C:/")


def file_url_path(text: str) -> "str | None":
    """The path a ``file://`` URL of this machine names (``file:///x``, ``file://localhost/x``,
    unquoted); None for any other text."""
    url = urlparse(text)
    return unquote(url.path) if url.scheme == "file" and url.netloc in ("", "localhost") else None


def output_path(name: str, value):
    """``value`` as ``given_path`` takes it, and not a URL: a dataset is written to a local or
    mounted filesystem, where its shards are read with cuFile (as a path, ``s3://bucket/ds`` would
    become a folder ``s3:/bucket/ds`` under the current one)."""
    value = given_path(name, value)
    text = os.fsdecode(value) if isinstance(value, (str, bytes, os.PathLike)) else ""
    if _SCHEME.match(text) or (isinstance(value, os.PathLike) and _FOLDED.match(text)):
        local = file_url_path(text)
        raise ValueError(f"{text}: {name} is a URL; a dataset is written to a local or mounted folder (cuFile "
                         f"reads its shards there){f': give the path, {local}' if local else ''}")
    return value


_COUNT = re.compile(r"[0-9]+")
SHARE = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)%")


def skip_limit(value):
    """A pack's ``max_skipped``, checked: None (no limit), a count of files (an int, or its digits,
    0 or more) or a share of the files to pack (a string "P%", 0 to 100). Returns the count as an
    int, the share as its string (stripped); ``skips_allowed`` turns either into a count."""
    if value is None:
        return None
    if not isinstance(value, str):
        return count("max_skipped", value, minimum=0)
    text = value.strip()
    if _COUNT.fullmatch(text):
        return int(text)
    if SHARE.fullmatch(text):
        if Fraction(text[:-1]) > 100:
            raise ValueError(f"max_skipped is a share of the files to pack, at most 100%, got {value!r}")
        return text
    raise ValueError(f"max_skipped must be a count of files (10) or a share of them (0.5%), got {value!r}")


def skips_allowed(limit, files: int):
    """How many of ``files`` a pack may skip under ``skip_limit``'s ``limit`` (None: any number)."""
    if limit is None or is_integer(limit):
        return limit
    return int(Fraction(limit[:-1].strip()) * files / 100)  # (exact: 29% of 100 is 29, not 28.999...)
