"""The all-reduce op's fault scenarios (``fault_scenarios``) played on the sequence-parallel ops: a
rank's one-sided bad input, a mismatched M (same and fewer chunks), a stalled rank, a rank that
closed its op, a killed rank, a lost put. Every live rank raises within deadline + 2 s, nothing
wrong is returned, and the op (or a fresh one) computes correctly afterwards. Real CPU rank
processes; short deadlines."""

import pytest

import fault_scenarios
from cco.comm import spawn

pytestmark = pytest.mark.multirank

DEADLINE_S = 3.0
N, K = 384, 256
# rows per call: the reduce-scatter along tokens has M/W rows per slice, so 2 chunks of 64 rows at
# world 4 need M = 512 (the "dropped" scenario loses chunk 1); the all-gather passes M rows per rank
ROWS = {"reduce-scatter-rows": 512, "reduce-scatter-cols": 128, "all-gather": 128}
SCENARIOS = ("bad-input", "m-mismatch", "m-mismatch-chunks", "stalled", "closed", "dropped", "killed")
CASES = [pytest.param(p, name, 2, id=f"{p}-{name}-w2") for p in ("reduce-scatter-rows", "all-gather")
         for name in SCENARIOS]
CASES += [pytest.param("reduce-scatter-rows", "dropped", 4, id="reduce-scatter-rows-dropped-w4"),
          pytest.param("all-gather", "m-mismatch", 4, id="all-gather-m-mismatch-w4"),
          pytest.param("reduce-scatter-cols", "bad-input", 2, id="reduce-scatter-cols-bad-input-w2")]


@pytest.mark.parametrize("pattern, name, world", CASES)
def test_every_live_rank_raises_in_time_and_the_op_recovers(pattern, name, world):
    """Guards, per scenario (``fault_scenarios`` states each promise), for the reduce-scatter's and
    the all-gather's protocols: a peer paired with a rejecting rank's next call, a reduce or a GEMM
    on rows that never arrived (stale bytes of the last call), a wait without a deadline, a rank
    that returns while a peer called with another M."""
    victim = world // 2
    setup = fault_scenarios.Setup(n=N, k=K, m=ROWS[pattern], deadline_s=DEADLINE_S, device="cpu", pattern=pattern)
    outcomes = spawn(fault_scenarios.run, world=world, args=(name, victim, setup, "cpu"), timeout_s=120)
    for o in outcomes:
        if name == "killed" and o.rank == victim:
            assert o.error_type == "Died" and o.exitcode == 9, o
            continue
        assert o.ok, f"rank {o.rank}: {o.error_type}: {o.error}"
        assert not o.value["problems"], "\n".join(o.value["problems"] + o.value["seen"])
