"""Argument pieces several GPU scripts share (``-m`` and the like: comma lists of row counts), so a
bad value is one usage line and exit 2 rather than a ValueError traceback. (The refusal of a run
without a CUDA GPU is ``cco.bench.timing.require_cuda``.)"""

from __future__ import annotations

import argparse
import os
import textwrap


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, except where there is none to show (None: an output not
    written, a value the run picks; a flag's False; an empty list: no extra arms). Lines break at
    spaces only, so a name such as rs-rows, 8b-down-tp8 or fused-lsa-fp8 reads as the user types it."""

    def _get_help_string(self, action):
        unset = action.default is None or action.default is False or action.default == []
        return action.help if unset else super()._get_help_string(action)

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


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


def shape_probe_args(doc: str, shapes, argv=None, quants: tuple[str, ...] = (), extra=None) -> argparse.Namespace:
    """The three positionals of a probe over tune_decode's shapes (``SHAPES M_LIST OUT.json``; the
    probe's module docstring ``doc`` gives the description): ``--help`` prints the usage, and a bad
    value is one usage line, not the ``KeyError`` of a shape named ``--help``. ``quants``: the probe
    also takes ``--quant`` (a comma list of them, default all). ``extra(parser)`` adds a probe's own
    options."""
    p = argparse.ArgumentParser(description=" ".join(doc.split("\n\n")[0].split()).replace("``", "").rstrip(":") + ".")
    if quants:
        p.add_argument("--quant", default=",".join(quants), help=f"comma list of {', '.join(quants)}")
    if extra is not None:
        extra(p)
    p.add_argument("shapes", help=f"comma list of tune_decode's shapes: {', '.join(shapes)}")
    p.add_argument("m", type=ints, help="comma list of row counts")
    p.add_argument("json", help="write the rows here")
    args = p.parse_args(argv)
    args.shapes = args.shapes.split(",")
    unknown = [s for s in args.shapes if s not in shapes]
    if unknown:
        p.error(f"unknown shapes {unknown}: pick from {', '.join(shapes)}")
    if quants:
        args.quant = args.quant.split(",")
        if [q for q in args.quant if q not in quants]:
            p.error(f"--quant {','.join(args.quant)}: pick from {', '.join(quants)}")
    where = os.path.dirname(args.json)
    if where and not os.path.isdir(where):  # now, not after every shape has been timed
        p.error(f"json {args.json}: directory {where} does not exist")
    return args


def drew_an_earlier_run(argv, script: str, plot) -> bool:
    """``--from RUN.json --plot OUT.png`` as a probe's whole command line: ``plot(RUN.json, OUT.png)``
    draws that earlier run's picture (no GPU) and this returns True; False for any other command
    line (the probe runs); a ``--from`` line of another shape is one usage line, exit status 1."""
    if not argv or argv[0] != "--from":
        return False
    if len(argv) != 4 or argv[2] != "--plot":
        raise SystemExit(f"usage: python3 -m scripts.{script} --from RUN.json --plot OUT.png")
    plot(argv[1], argv[3])
    return True
