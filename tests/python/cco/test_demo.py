"""The demo's own verdict: its error budget passes the reference and fails a wrong tile."""

import pytest

from cco import demo


@pytest.mark.parametrize("gather", ["bf16", "fp8"])
def test_demo_check_passes_the_reference_and_flags_a_wrong_tile(gather):
    opts = demo.parse_args(["--shape", "64x256x256", "--gather-dtype", gather])
    problems = [demo._operands(r, opts)[0] for r in range(2)]
    ref = sum(p.reference().float() for p in problems).bfloat16()
    assert demo._check(ref, problems, opts, reduced=True)[1] == 0
    wrong = ref.clone()
    wrong[:16, :32] = problems[0].reference()[:16, :32]  # one rank's partial only: a lost scatter
    assert demo._check(wrong, problems, opts, reduced=True)[1] > 0
    alone = problems[0].reference()
    assert demo._check(alone, problems[:1], opts, reduced=False)[1] == 0


@pytest.mark.parametrize("iters", ["0", "-2"])
def test_the_demo_refuses_iters_below_one(iters, capsys):
    """Before: ``--iters 0`` ran, then every rank raised IndexError (the first call's time of none)."""
    with pytest.raises(SystemExit) as exit_:
        demo.parse_args(["--iters", iters])
    assert exit_.value.code == 2 and f"--iters={iters} must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("args, says", [
    (["--shape", "256x511x512"], "n=511 is not divisible by world=2"),
    (["--shape", "256x512x100"], "k=100 is not supported"),
    (["--shape", "0x512x512"], "M, N and K must be >= 1"),
    (["--chunks", "0"], "chunks=0 is not supported"),
    (["--deadline", "0"], "--deadline=0.0 must be > 0 seconds"),
    (["--world", "0"], "--world=0 must be >= 1"),
    (["--world", "3", "--shape", "256x512x512"], "n=512 is not divisible by world=3"),
])
def test_the_demo_refuses_what_every_rank_would_at_parse_time(args, says, capsys, monkeypatch):
    """Before, each of these started the ranks and every rank printed its own traceback (54 lines
    each, the reason buried in them; ``--world 0`` a traceback from spawn)."""
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as exit_:
        demo.parse_args(args)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_the_demo_checks_the_shape_at_the_launchers_world(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(SystemExit):
        demo.parse_args(["--shape", "256x96x512"])  # 48 columns a rank at world 2 (the default) would do
    assert "at world 4: n=96 with world=4 gives a 24-column slice" in capsys.readouterr().err
    assert demo.parse_args(["--shape", "256x512x512"]).n == 512


@pytest.mark.multirank
def test_gemm_only_checks_against_the_gemms_budget_whatever_the_gather_dtype(capsys):
    """Before: ``--mode gemm-only --gather-dtype fp8`` checked against the fp8 gather's looser budget
    (tol 4e-02) although gemm-only gathers nothing."""
    assert demo.main(["--mode", "gemm-only", "--gather-dtype", "fp8", "--shape", "64x256x256", "--iters", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("(tol 3e-03)") == 2 and "4e-02" not in out, out
