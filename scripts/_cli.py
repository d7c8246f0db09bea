"""Argument pieces several GPU scripts share (``-m`` and the like: comma lists of row counts), so a
bad value is one usage line and exit 2 rather than a ValueError traceback. (The refusal of a run
without a CUDA GPU is ``cco.bench.timing.require_cuda``.)"""

from __future__ import annotations

import argparse


def ints(text: str) -> list[int]:
    """A comma list of integers >= 1, or an argparse error (a row count below 1 launches nothing, and
    a run over it would report ok)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of integers") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be >= 1")
    return values
