"""What a call raised, as a test on a rank reports it to the parent (one string, compared across
ranks: every rank must reach the same verdict)."""

from __future__ import annotations


def error_of(fn, *, notes: bool = False) -> str:
    """``"Type: message"`` of what ``fn()`` raised (``notes``: then its notes, a line each), ``"no
    error"`` if it returned."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test reads the type and message
        return f"{type(err).__name__}: {err}" + ("".join(f"\n{n}" for n in getattr(err, "__notes__", ())) if notes
                                                  else "")
    return "no error"
