"""The benchmark scripts' command lines refuse what they cannot do, in one line and before the run:
``bench_decode --smoke`` passes on a CPU torch (the unfused blockscale arm left out, saying so, where
there is no blockwise ``_scaled_mm``); a plot with nothing to draw, a ``--from`` file without what a
plot needs, a bad ``--shapes`` and a plot path matplotlib cannot write are errors, with no file
written; plot_results names the record's missing key and a baseline of no time; bench_gemm_ar writes
its JSON before its plot and records how it was launched. Nothing here needs a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RESULTS = os.path.join(ROOT, "docs", "results")


# ---- bench_decode ------------------------------------------------------------------------------------
def test_decode_smoke_passes_on_the_cpu():
    """``--smoke`` is the CPU check: an arm this torch cannot run (blockscale's unfused ``_scaled_mm``)
    is left out, saying why, as mxfp8's is, not a failed run (about 5 s)."""
    pytest.importorskip("transformers")
    done = subprocess.run([sys.executable, "-m", "scripts.bench_decode", "--smoke", "--batch", "1", "--quant",
                           "ptpc,blockscale"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "FAILED" not in done.stderr
    unfused = [line for line in done.stdout.splitlines() if "fp8 unfused blockscale" in line]
    assert unfused and all(line.endswith(" ok") or "left out: " in line for line in unfused), unfused


@pytest.mark.parametrize("argv, env, said", [
    (["--smoke", "--plot", "p.png"], {}, ("--plot", "--smoke")),
    (["--smoke", "--plot-per-call", "x.png"], {}, ("--plot-per-call", "--smoke")),
    (["--smoke", "--per-call-only", "--json", "j.json"], {}, ("--smoke", "--per-call-only")),
    (["--per-call-only", "--shapes", "8b-down-tp1,bogus"], {}, ("--shapes ['bogus'] unknown", "8b-o-tp1")),
    (["--plot", "p.txt"], {}, ("--plot p.txt", "matplotlib writes no .txt", ".png")),
    (["--per-call-only", "--plot-per-call", "x"], {}, ("--plot-per-call x", "without a suffix")),
    (["--smoke"], {"RANK": "0", "WORLD_SIZE": "2"}, ("--smoke", "world 2")),
    (["--per-call-only", "--plot-per-call", "x.png"], {"RANK": "0", "WORLD_SIZE": "2"}, ("--plot-per-call", "world 2")),
])
def test_decode_refuses_at_parse_time_what_would_write_nothing(capsys, monkeypatch, tmp_path, argv, env, said):
    from scripts import bench_decode as B

    monkeypatch.chdir(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exc:
        B.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    for words in said:
        assert words in err, (words, err)
    assert os.listdir(tmp_path) == []


def test_decode_plot_dir_is_refused(capsys, tmp_path):
    from scripts import bench_decode as B

    with pytest.raises(SystemExit) as exc:
        B.parse_args(["--plot", str(tmp_path)])
    assert exc.value.code == 2 and "a directory" in capsys.readouterr().err


def test_decode_plots_with_nothing_to_draw_write_no_file(tmp_path):
    """A model plot of rows without times (--smoke's, failed arms') and a per-call plot of rows without
    nn.Linear's arm (world W's) are errors, not empty axes."""
    pytest.importorskip("matplotlib")
    from scripts import bench_decode as B

    png = tmp_path / "p.png"
    with pytest.raises(SystemExit, match="no model arm has times to draw"):
        B.plot([{"batch": 1, "arm": "bf16", "ok": True}, {"batch": 1, "arm": "cco ptpc", "error": "x"}], str(png))
    w2 = json.load(open(os.path.join(RESULTS, "2026-12-02_decode_world2_shared_h100.json")))
    with pytest.raises(SystemExit, match="no per-call row has the nn.Linear bf16 arm"):
        B.plot_per_call(w2["per_call"], str(png))
    assert not png.exists()


def test_decode_from_a_file_without_what_the_plot_needs(tmp_path):
    from scripts import bench_decode as B

    png = tmp_path / "w2.png"
    w2 = os.path.join(RESULTS, "2026-12-02_decode_world2_shared_h100.json")
    with pytest.raises(SystemExit) as exc:
        B.main(["--from", w2, "--plot-per-call", str(png)])
    assert "has no per_call rows with the nn.Linear bf16 arm" in str(exc.value.code) and w2 in str(exc.value.code)
    no_runs = tmp_path / "m.json"
    no_runs.write_text(json.dumps({"model": {"layers": 2, "hidden": 256}}))
    with pytest.raises(SystemExit) as exc:  # (was: KeyError: 'runs')
        B.main(["--from", str(no_runs), "--plot", str(png)])
    assert "no model rows (model.runs with times)" in str(exc.value.code) and str(no_runs) in str(exc.value.code)
    assert not png.exists()


# ---- plot_results ------------------------------------------------------------------------------------
def _sweep(tmp_path, drop=(), base_us=100.0):
    arm = {"median_us": 90.0, "min_us": 89.0, "max_us": 91.0}
    record = {"m": 2048, "n": 7168, "k": 2048, "quant": "ptpc", "world": 2, "pattern": "ar",
              "arms": {"scaled_mm+nccl": {"median_us": base_us, "min_us": base_us, "max_us": base_us}, "fused": arm}}
    for key in drop:
        del record[key]
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps({"results": [record, {**record, "m": 4096}]}))
    return str(path)


@pytest.mark.parametrize("out, said", [("dir/", "a directory"), ("x.txt", "matplotlib writes no .txt"),
                                       ("noext", "matplotlib writes no file without a suffix")])
def test_plot_results_refuses_an_out_it_cannot_write(capsys, tmp_path, out, said):
    pytest.importorskip("matplotlib")
    from scripts import plot_results as P

    (tmp_path / "dir").mkdir()
    out = str(tmp_path / out)
    with pytest.raises(SystemExit) as exc:
        P.parse_args([_sweep(tmp_path), "--out", out])
    assert exc.value.code == 2 and f"--out {out}: {said}" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["dir", "sweep.json"] and os.listdir(tmp_path / "dir") == []


def test_plot_results_names_a_missing_key_and_a_zero_baseline(tmp_path):
    pytest.importorskip("matplotlib")
    from scripts import plot_results as P

    out = tmp_path / "o.png"
    for key in ("quant", "n", "k", "world"):
        path = _sweep(tmp_path, drop=(key,))
        with pytest.raises(SystemExit) as exc:  # (was: KeyError from the title)
            P.main([path, "--out", str(out)])
        assert f"plot_results: {path}: the record of M=2048 has no {key}" in str(exc.value.code)
    with pytest.raises(SystemExit, match="baseline scaled_mm\\+nccl at M=2048 has median_us 0"):
        P.main([_sweep(tmp_path, base_us=0.0), "--out", str(out)])  # (was: ZeroDivisionError)
    assert not out.exists()
    P.main([_sweep(tmp_path), "--out", str(out)])
    assert out.stat().st_size > 10_000


def test_plot_results_mark_help_says_the_label_it_draws(capsys):
    """``--mark`` labels its point "not understood: see the page" (plot draws that text): the help says so."""
    from scripts import plot_results as P

    with pytest.raises(SystemExit):
        P.parse_args(["--help"])
    assert "'not understood: see the page'" in " ".join(capsys.readouterr().out.split())


# ---- bench_gemm_ar -----------------------------------------------------------------------------------
def test_gemm_ar_refuses_a_plot_suffix_at_parse_time(capsys):
    from scripts.bench_gemm_ar import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--sweep", "--plot", "sweep.txt", "--json", "sweep.json"])
    assert exc.value.code == 2 and "--plot sweep.txt: matplotlib writes no .txt" in capsys.readouterr().err
    assert parse_args(["--sweep", "--plot", "sweep.svg"]).plot == "sweep.svg"


class _OneRank:
    rank, world = 0, 1

    class device:
        type = "cuda"

    def barrier(self):
        pass

    def close(self):
        pass


def test_gemm_ar_writes_its_json_before_the_plot_and_records_torchrun(tmp_path, monkeypatch, capsys):
    """A sweep whose plot fails keeps its JSON and RESULT_JSON line; ``command`` says how it was
    launched (torchrun's environment: its --nproc-per-node). The GPU parts stubbed."""
    import torch

    import cco.comm
    from scripts import bench_gemm_ar as G

    monkeypatch.setattr(G, "require_cuda", lambda what: None)
    monkeypatch.setattr(cco.comm.Communicator, "from_env", staticmethod(lambda: _OneRank()))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "stub")
    monkeypatch.setattr(G, "select_arms", lambda *a: ["split"])
    monkeypatch.setattr(G, "require_a_gpu_per_rank", lambda *a: None)
    monkeypatch.setattr(G, "run_shape", lambda args, comm, m, **kw: {"m": m, "arms": {}})
    monkeypatch.setattr(G, "print_table", lambda res: None)
    monkeypatch.setattr(G, "exit_status", lambda comm, results: 0)

    def plot_fails(results, path):
        raise RuntimeError("the plot failed")

    monkeypatch.setattr(G, "plot", plot_fails)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    out = tmp_path / "sweep.json"
    with pytest.raises(RuntimeError, match="the plot failed"):
        G.main(["--sweep", "--plot", str(tmp_path / "sweep.png"), "--json", str(out)])
    saved = json.loads(out.read_text())
    assert [r["m"] for r in saved["results"]] == list(G.SWEEP_M)
    assert saved["command"] == (f"torchrun --nproc-per-node 2 -m scripts.bench_gemm_ar --sweep --plot "
                                f"{tmp_path / 'sweep.png'} --json {out}")
    assert "RESULT_JSON " in capsys.readouterr().out
