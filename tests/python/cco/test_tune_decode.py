"""``scripts/tune_decode.py`` on the host: the configs it sweeps per kernel, which constants a config
sets, and the plot drawn from a run's JSON (no GPU)."""

from __future__ import annotations

import os

import pytest

from scripts import tune_decode as T

RUN = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "results",
                   "2026-12-03_decode_rows_kernel_h200.json")


def test_configs_per_kernel_respect_the_formats_steps():
    """One row: the one-row kernel's sweep; more: the rows kernel's, whose blockscale step is one
    128-column scale group and whose blocks divide 128 (a program's rows share a scale block)."""
    assert all(cfg[1] >= 512 for cfg in T.configs("ptpc", 1))
    for quant in ("ptpc", "blockscale", "mxfp8"):
        rows = T.configs(quant, 4)
        assert rows and all(128 % cfg[0] == 0 and cfg[1] in (128, 256) for cfg in rows)
    assert {cfg[1] for cfg in T.configs("blockscale", 2)} == {128}


def test_with_config_sets_the_tables_of_the_kernel_that_takes_m(monkeypatch):
    from kernels_fused.hopper import decode as D

    for name in ("BLOCK_N", "BLOCK_K", "NUM_WARPS", "NUM_STAGES", "ROWS_BLOCK_N", "ROWS_BLOCK_K", "ROWS_WARPS",
                 "ROWS_STAGES", "WIDE_BLOCK_N", "WIDE_BLOCK_K", "WIDE_WARPS", "WIDE_STAGES"):
        monkeypatch.setattr(D, name, dict(getattr(D, name)))
    one = dict(D.BLOCK_N)
    T.with_config((16, 128, 8, 3), "mxfp8", 3)
    assert (D.ROWS_BLOCK_N["mxfp8"], D.ROWS_BLOCK_K["mxfp8"], D.ROWS_WARPS["mxfp8"], D.ROWS_STAGES["mxfp8"]) == (
        16, 128, 8, 3)
    assert D.BLOCK_N == one  # the one-row kernel's untouched
    T.with_config((8, 512, 4, 3), "mxfp8", 1)
    assert (D.BLOCK_N["mxfp8"], D.BLOCK_K["mxfp8"]) == (8, 512) and D.ROWS_BLOCK_N["mxfp8"] == 16
    T.with_config((32, 128, 8, 4), "ptpc", D.ROWS_MAX + 1)  # ptpc past the rows kernel: the wide MMA's
    assert (D.WIDE_BLOCK_N["ptpc"], D.WIDE_WARPS["ptpc"]) == (32, 8) and D.ROWS_BLOCK_N["ptpc"] != 32
    T.with_config((32, 512, 4, 3), "mxfp8", D.ROWS_MAX + 1)  # mxfp8 past it: the one-row kernel's
    assert D.BLOCK_N["mxfp8"] == 32 and "mxfp8" not in D.WIDE_BLOCK_N
    T.with_config((8, 512, 4, 3), "ptpc", D.rows_max("ptpc") + 1)  # past the wide MMA: the one-row kernel's
    assert D.BLOCK_N["ptpc"] == 8


def test_plot_from_a_runs_json(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "tune.png"
    assert T.main(["--from", RUN, "--plot", str(out)]) == 0
    assert out.stat().st_size > 10_000


def test_best_configs_per_kernel_are_the_least_geometric_mean():
    """The config with the least geometric mean over bf16 among those timed at every cell of its
    kernel (a config missing a cell, one that did not compile there, is not a candidate)."""
    row = lambda m, bf16, **us: {"m": m, "quant": "ptpc", "us": {"nn.Linear bf16": bf16, **{  # noqa: E731
        f"decode {k}": v for k, v in us.items()}}}
    rows = [row(2, 10.0, a=5.0, b=8.0, c=1.0), row(8, 10.0, a=20.0, b=9.0),  # c: one cell only
            row(32, 10.0, a=3.0, b=4.0), row(1, 10.0, a=7.0), {"m": 4, "quant": "ptpc", "error": "x"}]
    best = T.best_configs(rows)
    assert best["ptpc rows"]["config"] == "b" and best["ptpc rows"]["cells"] == 2  # 0.849 against a's 1.0
    assert abs(best["ptpc rows"]["ratio"] - (0.8 * 0.9) ** 0.5) < 1e-12
    assert best["ptpc wide"]["config"] == "a" and best["ptpc row"]["config"] == "a"
