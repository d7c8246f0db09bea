"""What a call raised, as a test on a rank reports it to the parent (one string, compared across
ranks: every rank must reach the same verdict)."""

from __future__ import annotations


def error_of(fn) -> str:
    """``"Type: message"`` of what ``fn()`` raised, ``"no error"`` if it returned."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test reads the type and message
        return f"{type(err).__name__}: {err}"
    return "no error"
