"""Byte sizes as users write them: `1073741824`, `512MB`, `1GiB`, `1.5G`.

Decimal units for K/KB, M/MB, G/GB, T/TB (as disks and object stores count), binary ones for
KiB, MiB, GiB, TiB. A leaf module: the CLI (`--shard-size`, `--cache-limit`, `--max-memory`) and
the library (`Dataset(cache_limit="50GB")`) parse sizes with the same rules.
"""

from __future__ import annotations

import re

from gdsload.errors import SizeError  # noqa: F401 (re-exported: defined in errors.py)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """`text` in bytes; raises `SizeError` naming the text for anything else (units: module doc)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise SizeError(f"invalid size {text!r}: use bytes or a number with a unit such as 512MB, 1GiB")
    n = int(float(m.group(1)) * _UNITS[unit])
    if n <= 0:
        raise SizeError(f"invalid size {text!r}: must be positive")
    return n


def argparse_size(text: str) -> int:
    """`parse_size` for argparse's `type=`: a bad size becomes argparse's usage error (exit 2)."""
    import argparse

    try:
        return parse_size(text)
    except SizeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
