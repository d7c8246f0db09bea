"""argparse types shared by the schedule CLIs (verify, simulate)."""

from __future__ import annotations

import argparse


def _ints(text: str, n: int, flag: str, example: str) -> tuple:
    try:
        values = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        values = ()
    if len(values) != n:
        raise argparse.ArgumentTypeError(f"{flag} {text!r}: expected {example}")
    return values


def tile(text: str) -> tuple:
    """``256x128`` -> (BLOCK_M, BLOCK_N)."""
    return _ints(text, 2, "--tile", "BLOCK_MxBLOCK_N such as 256x256")


def shape(text: str) -> tuple:
    """``4096x7168x256`` -> (M, N, K)."""
    return _ints(text, 3, "--shape", "MxNxK such as 4096x7168x256")


def onoff(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


def loop_count(text: str):
    """A named main-loop count policy (``2A+B``, ...) or an explicit vmcnt."""
    return int(text) if text.isdigit() else text
