"""``examples/tp_mlp.py`` runs as its docstring says and passes its own checks: spawned CPU ranks
(TP 2 x DP 2, eager and compiled, forward and backward) and ranks started by torchrun."""

import pytest

from examples import tp_mlp
from tests.python.cco.cpu_ranks import torchrun_two_ranks

pytestmark = pytest.mark.multirank


def test_tp_mlp_eager_and_compiled_with_gradients_on_tp2_by_dp2(capsys):
    """4 CPU ranks in two TP groups: every arm (eager, ``torch.compile(fullgraph=True)`` under
    inductor) within its tolerance of the unfused model, gradients included."""
    assert tp_mlp.main(["--world", "4", "--tp", "2", "--train", "--compile", "both"]) == 0
    out = capsys.readouterr().out
    assert "world 4, TP 2" in out and "PASS" in out
    for line in ("eager    y vs quantized unfused", "compiled y vs unfused bf16 model", "compiled down grad vs unfused"):
        assert line in out, out


def test_tp_mlp_under_torchrun():
    proc = torchrun_two_ranks("-m", "examples.tp_mlp", "--compile", "off", "--quant", "blockscale",
                              "--intermediate", "1000", timeout_s=300)
    assert "PASS" in proc.stdout and "padded" in proc.stdout, proc.stdout  # 500 columns per rank: K padded


def test_hf_generate_under_torchrun():
    """``examples/hf_generate.py`` with no argument: a random Llama saved, loaded back through the cco
    plan on 2 CPU ranks, prefill within the fp8 budget and greedy tokens identical on both ranks."""
    pytest.importorskip("transformers")
    proc = torchrun_two_ranks("-m", "examples.hf_generate", timeout_s=300)
    out = proc.stdout
    assert out.rstrip().endswith("PASS"), out
    assert "fused: 4 layers (model.layers.*.mlp.down_proj, model.layers.*.self_attn.o_proj)" in out, out
    assert "identical on every rank -> ok" in out and "bias=True" in out, out


def test_tp_mlp_sequence_parallel_eager_and_compiled_with_gradients(capsys):
    """2 CPU ranks, ``--sequence-parallel``: gate/up through ColumnParallelLinear(sequence_parallel=True)
    (all-gather + GEMM), down through RowParallelLinear(sequence_parallel=True) (GEMM + reduce-scatter),
    eager and compiled, forward and backward within tolerance of the unfused bf16 model."""
    assert tp_mlp.main(["--world", "2", "--sequence-parallel", "--train", "--compile", "both", "--seq", "12"]) == 0
    out = capsys.readouterr().out
    assert "sequence parallel" in out and "PASS" in out, out
    for line in ("eager    y vs unfused bf16 model", "compiled down grad vs unfused",
                 "compiled gate/up grad vs unfused"):
        assert line in out, out


@pytest.mark.parametrize("tp", ["-1", "0", "3"])
def test_tp_mlp_refuses_a_tp_size_that_does_not_divide_the_world(tp, capsys):
    """Before: ``--tp -1`` raised IndexError on every rank and ``--tp 0`` ran as TP = world."""
    with pytest.raises(SystemExit) as exit_:
        tp_mlp.main(["--world", "2", "--tp", tp, "--compile", "off"])
    said = str(exit_.value.code) + capsys.readouterr().err
    assert f"--tp={tp} must be a positive divisor of the world" in said, said


@pytest.mark.parametrize("args, says", [
    (["--world", "0"], "--world=0 must be >= 1"),
    (["--batch", "0"], "--batch=0 must be >= 1"),
    (["--hidden", "0"], "--hidden=0 must be >= 1"),
    (["--seq", "0", "--sequence-parallel"], "--seq=0 must be >= 1"),
    (["--seq", "3", "--batch", "1", "--sequence-parallel"], "3 tokens must be a multiple of TP=2"),
])
def test_tp_mlp_refuses_sizes_before_any_rank_starts(args, says, capsys, monkeypatch):
    """Before: ``--batch 0`` printed PASS (errors of empty tensors), ``--hidden 0`` divided by zero,
    ``--world 0`` named ``--tp``, and tokens that do not split over TP raised SystemExit inside each
    rank (a SpawnError traceback)."""
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as exit_:
        tp_mlp.main(["--world", "2", "--compile", "off", *args])
    said = str(exit_.value.code) + capsys.readouterr().err
    assert says in said, said


@pytest.mark.parametrize("args, says", [
    (["--model", "/nonexistent"], "not a local checkpoint folder (no config.json in it)"),
    (["--batch", "0"], "--batch=0 must be >= 1"),
    (["--new-tokens", "0"], "--new-tokens=0 must be >= 1"),
])
def test_hf_generate_refuses_arguments_before_loading(args, says, capsys):
    """Before: each of these ran into 100-180 lines of tracebacks from every rank under torchrun."""
    from examples import hf_generate

    with pytest.raises(SystemExit) as exit_:
        hf_generate.parse_args(args)
    assert exit_.value.code == 2 and says in capsys.readouterr().err
