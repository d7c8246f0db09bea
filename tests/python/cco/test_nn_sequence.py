"""Sequence-parallel layers on CPU ranks: ``ColumnParallelLinear(sequence_parallel=True)`` ->
``RowParallelLinear(sequence_parallel=True)``, forward and backward, against the unfused model.

The unfused model: the full activations ``x [S, B, H]`` (tokens first), ``h_r = x @ W1_r.T`` with
``x`` and ``W1_r`` quantized as the layer quantizes them, ``y = sum_r h_r @ W2_r.T`` (fp8 operands,
partials in fp32 rounded to bf16, summed in fp32), rank r's tokens ``S/W`` of it; the gradients
straight through the quantization with the dequantized weights. Guards: a rank handed another
rank's tokens (gather order, scatter rows), a token dimension that is not the first, gradients that
miss a rank's share (the dual collectives of the backward), eager and compiled paths that differ,
the unfused fallback computing something else than the fused path.
"""

from __future__ import annotations

import pytest
import torch

from cco import quant as Q
from cco.comm import check_outcomes, spawn

pytestmark = pytest.mark.multirank

DEADLINE_S = 20.0
S, B, H, I = 8, 3, 256, 512  # tokens S x batch B; hidden H; intermediate I (split over the ranks)


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, H, generator=g).to(torch.bfloat16)
    # bf16 values: a trainable layer quantizes its bf16 master weight
    w1 = (torch.randn(I, H, generator=g) * H ** -0.5).to(torch.bfloat16).float()
    w2 = (torch.randn(H, I, generator=g) * I ** -0.5).to(torch.bfloat16).float()
    grad_y = torch.randn(S, B, H, generator=g).to(torch.bfloat16)
    return x, w1, w2, grad_y


def shards(rank, world):
    x, w1, w2, grad_y = problem()
    i, s = I // world, S // world
    return (x[rank * s:(rank + 1) * s], w1[rank * i:(rank + 1) * i], w2[:, rank * i:(rank + 1) * i],
            grad_y[rank * s:(rank + 1) * s])


def _block(comm, quant, mode, compiled, backward="bf16"):
    from cco.nn import ColumnParallelLinear, RowParallelLinear

    world, rank = comm.world, comm.rank
    x_r, w1_r, w2_r, gy_r = shards(rank, world)
    col = ColumnParallelLinear(H, I // world, group=comm, quant=quant, m_max=S * B, mode=mode, sequence_parallel=True,
                               trainable=True, bias=True, deadline_s=DEADLINE_S, backward=backward)
    row = RowParallelLinear(I // world, H, group=comm, quant=quant, m_max=S * B, mode=mode, sequence_parallel=True,
                            trainable=True, deadline_s=DEADLINE_S, backward=backward)
    col.load_weight(w1_r)
    row.load_weight(w2_r)

    def block(x):
        h = col(x)
        return h, row(h)

    results = {}
    arms = {"eager": block}
    if compiled:
        arms["compiled"] = torch.compile(block, fullgraph=True)
    for name, fn in arms.items():
        col.zero_grad(set_to_none=True)
        row.zero_grad(set_to_none=True)
        x = x_r.clone().requires_grad_(True)
        h, y = fn(x)
        before = [0 if layer._dual is None else layer._dual.op.calls for layer in (col, row)]
        (y.float() * gy_r.float()).sum().backward()
        # the backward's fused dual ops (an op may be shared with a forward of the same family)
        dual_calls = tuple(None if layer._dual is None else layer._dual.op.calls - b
                           for layer, b in zip((col, row), before))
        results[name] = dict(h=h.detach(), y=y.detach(), grad_x=x.grad, grad_w1=col.weight.grad.clone(),
                             grad_w2=row.weight.grad.clone(), grad_b1=col.bias.grad.clone(), dual_calls=dual_calls)
    results["paths"] = (repr(col), repr(row))
    results["w1q"] = col.dequantized_weight()
    results["w2q"] = row.dequantized_weight()
    col.close()
    row.close()
    return results


def quantized_gemm(a, w, quant):
    """reference_gemm of ``a [M, K]`` and ``w [N, K]`` quantized as the layers do (K padded to whole
    128-wide tiles, at least two)."""
    from cco import layout

    k = layout.padded_k(a.shape[1])
    aq, a_s = Q.quantize_a(torch.nn.functional.pad(a.float(), (0, k - a.shape[1])), quant)
    bq, b_s = Q.quantize_b(torch.nn.functional.pad(w.float(), (0, k - w.shape[1])), quant)
    return Q.reference_gemm(aq, bq, a_s, b_s, quant)


CASES = [pytest.param(2, "ptpc", "fused", True, "bf16", id="w2-ptpc-fused-eager-and-compiled"),
         pytest.param(2, "blockscale", "split", False, "bf16", id="w2-blockscale-split"),
         pytest.param(2, "mxfp8", "unfused", False, "bf16", id="w2-mxfp8-unfused"),
         pytest.param(4, "ptpc", "fused", False, "bf16", id="w4-ptpc-fused"),
         pytest.param(2, "blockscale", "fused", True, "fp8", id="w2-blockscale-fp8-backward-eager-and-compiled"),
         pytest.param(4, "ptpc", "split", False, "fp8", id="w4-ptpc-fp8-backward")]
GRAD_TOL = {"bf16": 2e-2,  # bf16 rounding of the backward's products
            "fp8": 0.1}  # e4m3 gradients and weights in the dual ops (one e4m3 rounding each: a few percent)


@pytest.mark.parametrize("world, quant, mode, compiled, backward", CASES)
def test_sequence_parallel_block_forward_and_backward_are_the_unfused_models(world, quant, mode, compiled, backward):
    per_rank = check_outcomes(spawn(_block, world=world, args=(quant, mode, compiled, backward), timeout_s=300))
    tol = GRAD_TOL[backward]
    x, w1, w2, grad_y = problem()
    x2, gy2 = x.reshape(-1, H), grad_y.reshape(-1, H).float()
    i, rows = I // world, S // world
    hs = [r["eager"]["h"] for r in per_rank]
    y_full = sum(quantized_gemm(h.reshape(-1, i), shards(r, world)[2], quant).float()
                 for r, h in enumerate(hs)).to(torch.bfloat16).view(S, B, H)
    gh = [gy2 @ r["w2q"].float() for r in per_rank]  # dL/dh_r: every rank's grad_y through its W2 columns
    grad_x = sum(gh[r] @ per_rank[r]["w1q"].float() for r in range(world)).view(S, B, H)
    for rank, res in enumerate(per_rank):
        assert ("path=fused" in res["paths"][0]) == (mode != "unfused"), res["paths"]
        for name in [n for n in ("eager", "compiled") if n in res]:
            got = res[name]
            h_ref = quantized_gemm(x2, shards(rank, world)[1], quant).view(S, B, i)
            assert got["h"].shape == (S, B, i) and Q.count_mismatches(got["h"], h_ref) == 0, name
            mine = slice(rank * rows, (rank + 1) * rows)
            assert got["y"].shape == (rows, B, H)
            assert Q.count_mismatches(got["y"], y_full[mine]) == 0, (name, rank)
            assert Q.rel_l2(got["grad_x"].float(), grad_x[mine]) < tol, (name, rank)
            assert Q.rel_l2(got["grad_w2"].float(), gy2.t() @ hs[rank].reshape(-1, i).float()) < tol, name
            assert Q.rel_l2(got["grad_w1"].float(), gh[rank].t() @ x2.float()) < tol, name
            assert Q.rel_l2(got["grad_b1"].float(), gh[rank].sum(0)) < tol, name
            assert got["dual_calls"] == ((None, None) if backward == "bf16" else (1, 1)), got["dual_calls"]
        if "compiled" in res:
            assert torch.equal(res["compiled"]["y"], res["eager"]["y"])
            assert torch.equal(res["compiled"]["grad_x"], res["eager"]["grad_x"])


# --------------------------------------------------------------------------------------------------
def _replicated_column(comm):
    from cco.nn import ColumnParallelLinear

    x, w1, _, _ = problem()
    w1_r = shards(comm.rank, comm.world)[1]
    col = ColumnParallelLinear(H, I // comm.world, group=comm, quant="ptpc", m_max=16, deadline_s=DEADLINE_S)
    col.load_weight(w1_r)
    with torch.no_grad():
        out = col(x)  # 24 rows through m_max=16: two local calls
    text = repr(col)
    col.close()
    return out, text


def test_column_parallel_without_sequence_parallelism_is_a_local_gemm():
    per_rank = check_outcomes(spawn(_replicated_column, world=2, timeout_s=120))
    x = problem()[0]
    for rank, (out, text) in enumerate(per_rank):
        ref = quantized_gemm(x.reshape(-1, H), shards(rank, 2)[1], "ptpc").view(S, B, I // 2)
        assert "sequence_parallel=False" in text and "path=fused" in text
        assert out.shape == (S, B, I // 2) and Q.count_mismatches(out, ref) == 0


def _bad_tokens(comm):
    from cco.nn import RowParallelLinear

    row = RowParallelLinear(128, 256, group=comm, m_max=64, sequence_parallel=True, deadline_s=DEADLINE_S)
    row.load_weight(torch.randn(256, 128))
    tokens = 3 if comm.rank == 0 else 4  # rank 0: not a multiple of the world
    try:
        row(torch.randn(tokens, 128))
        first = ("returned", "")
    except Exception as err:
        first = (type(err).__name__, str(err))
    again = row(torch.randn(4, 128))
    row.close()
    return first, again.shape


def test_a_rank_whose_tokens_do_not_split_fails_the_call_on_every_rank():
    per_rank = check_outcomes(spawn(_bad_tokens, world=2, timeout_s=60))
    (kind0, msg0), shape0 = per_rank[0]
    (kind1, msg1), shape1 = per_rank[1]
    assert kind0 == "ValueError" and "not a multiple of the world" in msg0, msg0
    assert kind1 == "PeerRejectedError" and "rank 0 rejected" in msg1, msg1
    assert shape0 == shape1 == (2, 256)


def _wrong_device_on_one_rank(comm, kind, grad):
    """Rank 1 passes its rows on the meta device (a tensor on another device than the layer's),
    rank 0 real ones; then both call again with real rows."""
    from cco.nn import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    sp = kind != "row"
    if kind == "column-sp":
        layer = ColumnParallelLinear(128, 64, group=comm, m_max=16, sequence_parallel=True, deadline_s=5,
                                     trainable=grad)
    else:
        layer = RowParallelLinear(128, 256, group=comm, m_max=16, sequence_parallel=sp, deadline_s=5,
                                  trainable=grad)
    layer.load_weight(torch.randn(layer.out_features, layer.in_features_per_rank) / 16)
    device = "meta" if comm.rank == 1 else "cpu"
    try:
        with torch.set_grad_enabled(grad):
            y = layer(torch.randn(4, 128, device=device, requires_grad=grad))
        first = ("returned", str(y.device))
    except Exception as err:
        first = (type(err).__name__, str(err))
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(comm.rank))
    with torch.no_grad():
        again = layer(x)
    layer.close()
    return first, again


@pytest.mark.parametrize("kind,grad", [("row-sp", False), ("column-sp", True), ("row", True)])
def test_a_rank_whose_input_is_on_another_device_fails_the_call_on_every_rank(kind, grad):
    """Before, a sequence-parallel row layer's call (any layer's, where a gradient is recorded) on
    a meta tensor reached the registered op's fake kernel: that rank returned a meta tensor without
    taking part, its peer's call paired with the rank's next one and returned a wrong result, and
    the peer's next call timed out. Now the rank refuses the call before the op, naming the devices,
    and its peer fails the same call."""
    per_rank = check_outcomes(spawn(_wrong_device_on_one_rank, world=2, args=(kind, grad), timeout_s=90))
    (kind0, msg0), y0 = per_rank[0]
    (kind1, msg1), y1 = per_rank[1]
    assert kind1 == "ValueError" and "x is on meta" in msg1 and "x.to(layer.device)" in msg1, (kind1, msg1)
    assert kind0 == "PeerRejectedError" and "rank 1 rejected" in msg0, (kind0, msg0)
    assert y0.device.type == y1.device.type == "cpu" and torch.isfinite(y0).all() and torch.isfinite(y1).all()


def _one_rank_refuses_the_pattern(comm):
    """Rank 1's backend does not run the all-gather / reduce-scatter patterns (as the GPU backends
    today); rank 0's does."""
    from cco.backends.cpu import CpuBackend
    from cco.nn import ColumnParallelLinear, RowParallelLinear

    if comm.rank == 1:
        CpuBackend.patterns = ("all-reduce",)
    x_r, w1_r, w2_r, _ = shards(comm.rank, comm.world)
    col = ColumnParallelLinear(H, I // 2, group=comm, m_max=S * B, sequence_parallel=True, deadline_s=DEADLINE_S)
    row = RowParallelLinear(I // 2, H, group=comm, m_max=S * B, sequence_parallel=True, deadline_s=DEADLINE_S)
    col.load_weight(w1_r)
    row.load_weight(w2_r)
    with torch.no_grad():
        h = col(x_r)
        y = row(h)
    paths = (repr(col), repr(row))
    col.close()
    row.close()
    return h, y, paths


def test_a_rank_whose_backend_refuses_the_pattern_sends_every_rank_unfused():
    """Guards: ranks that take different paths (one fused, one unfused) wait on each other's
    collectives forever or pair wrong data."""
    per_rank = check_outcomes(spawn(_one_rank_refuses_the_pattern, world=2, timeout_s=120))
    x, _, _, _ = problem()
    hs = [r[0] for r in per_rank]
    y_full = sum(quantized_gemm(h.reshape(-1, I // 2), shards(r, 2)[2], "ptpc").float()
                 for r, h in enumerate(hs)).to(torch.bfloat16).view(S, B, H)
    for rank, (h, y, paths) in enumerate(per_rank):
        for text in paths:
            assert "path=unfused (rank 1: cpu: the cpu backend does not run the" in text, text
        h_ref = quantized_gemm(x.reshape(-1, H), shards(rank, 2)[1], "ptpc").view(S, B, I // 2)
        assert Q.count_mismatches(h, h_ref) == 0
        assert Q.count_mismatches(y, y_full[rank * S // 2:(rank + 1) * S // 2]) == 0


def _load_errors(comm):
    from cco.nn import ColumnParallelLinear

    col = ColumnParallelLinear(H, 64, group=comm, m_max=16, deadline_s=DEADLINE_S)
    errors = []
    for call in (lambda: col.load_weight(torch.zeros(H, 64)), lambda: col.load_weight(torch.zeros(64, H).to(Q.FP8)),
                 lambda: col.load_fp8(torch.zeros(64, H).to(Q.FP8), torch.ones(3))):
        try:
            call()
            errors.append("accepted")
        except (TypeError, ValueError) as err:
            errors.append(str(err))
    col.close()
    return errors


def test_column_weight_errors_name_the_column_layer_and_its_shard():
    (errors,) = check_outcomes(spawn(_load_errors, world=1, timeout_s=60))
    assert "ColumnParallelLinear.load_weight" in errors[0] and "[out_features_per_rank, in_features]" in errors[0]
    assert "ColumnParallelLinear.load_weight" in errors[1] and "load_fp8" in errors[1]
    assert "ColumnParallelLinear.load_fp8: w_scale" in errors[2], errors


# --------------------------------------------------------------------------------------------------
# a rank that never runs its backward
def _one_rank_skips_its_backward(comm, layer_kind, mode):
    """Both ranks run the forward; rank 1 never runs the backward (as after an error between the
    two) and stays alive 8 s (a peer that exits closes gloo's connection, which ends any wait at
    once); rank 0's backward: its verdict and how long it took."""
    import time

    from cco.nn import ColumnParallelLinear, RowParallelLinear, WindowPool

    torch.manual_seed(0)
    if layer_kind == "column":
        layer = ColumnParallelLinear(256, 128, group=comm, m_max=16, mode=mode, sequence_parallel=True, deadline_s=2,
                                     pool=WindowPool())
        layer.load_weight(torch.randn(128, 256))
        x = torch.randn(4, 256, requires_grad=True)
    else:
        layer = RowParallelLinear(256, 256, group=comm, m_max=16, mode=mode, sequence_parallel=True, deadline_s=2,
                                  pool=WindowPool())
        layer.load_weight(torch.randn(256, 256))
        x = torch.randn(8, 256, requires_grad=True)
    y = layer(x)
    if comm.rank == 1:
        time.sleep(8)
        return "skipped"
    start = time.monotonic()
    try:
        y.float().sum().backward()
        verdict = "ran"
    except Exception as err:
        verdict = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return verdict, time.monotonic() - start


@pytest.mark.parametrize("layer_kind,mode", [("column", "unfused"), ("row", "fused")])
def test_a_rank_that_never_runs_its_backward_fails_its_peers_backward_within_the_deadline(layer_kind, mode):
    """Before, the peer's backward waited in the bf16 collective of the sequence-parallel backward
    (the reduce-scatter of grad_x, the all-gather of grad_y) until the group's own timeout (torch's
    default: 30 minutes on a job's group; here the spawn's timeout), not deadline_s. Now the
    backward agrees its call first and raises CommTimeoutError after deadline_s (2 s)."""
    outs = spawn(_one_rank_skips_its_backward, world=2, args=(layer_kind, mode), timeout_s=90)
    assert outs[1].ok and outs[1].value == "skipped", (outs[1].error_type, outs[1].error)
    assert outs[0].ok, (outs[0].error_type, outs[0].error)
    verdict, seconds = outs[0].value
    assert verdict.startswith("CommTimeoutError") and "this call's header" in verdict, verdict
    assert seconds < 2 + 4, seconds


def _sp_row_no_rows(comm, mode):
    from cco.nn import RowParallelLinear, WindowPool

    layer = RowParallelLinear(256, 256, group=comm, m_max=16, mode=mode, sequence_parallel=True, deadline_s=2,
                              pool=WindowPool())
    layer.load_weight(torch.randn(256, 256))
    found = {}
    with torch.no_grad():
        found["none anywhere"] = tuple(layer(torch.randn(0, 256)).shape)
        try:
            layer(torch.randn(0 if comm.rank == 1 else 8, 256))
            found["none against 8"] = "ok"
        except Exception as err:
            found["none against 8"] = type(err).__name__
    return found


@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_a_sequence_parallel_row_call_of_no_rows_is_agreed(mode):
    """Before, the fused layer raised ``GemmReduceScatterOp.__call__: a has M=0 rows`` (an op the
    caller never named) where every rank had none, while the column layer and the all-reduce layer
    return ``[0, N]``; now it returns ``[0, N]`` too, agreed: against a peer's rows it fails on both
    ranks (unfused: PeerMismatchError; fused: this rank's header times out and takes part in the
    peer's op call as a rejected one, which fails there by that rejection or its own timeout)."""
    outs = check_outcomes(spawn(_sp_row_no_rows, world=2, args=(mode,), timeout_s=60))
    for rank, found in enumerate(outs):
        assert found["none anywhere"] == (0, 256), found
        want = {"PeerMismatchError"} if mode == "unfused" else {"CommTimeoutError"} if rank == 1 else {
            "CommTimeoutError", "PeerRejectedError"}  # (rank 1 passes none: its header; rank 0 the op call)
        assert found["none against 8"] in want, (rank, found)


def _fp8_backward_skipped(comm):
    """A sequence-parallel block with backward="fp8" (ptpc: the row layer's dual all-gather op is
    the pool's op of the column layer's forward); rank 1 skips the backward and goes on to the next
    forward. Each rank: what its next step returned or raised."""
    import torch.nn.functional as F

    from cco.nn import ColumnParallelLinear, RowParallelLinear, WindowPool

    torch.manual_seed(0)
    pool = WindowPool()
    kw = dict(group=comm, m_max=8, sequence_parallel=True, trainable=True, backward="fp8", deadline_s=2, pool=pool)
    col, row = ColumnParallelLinear(128, 128, **kw), RowParallelLinear(128, 128, **kw)
    col.load_weight(torch.randn(128, 128))
    row.load_weight(torch.randn(128, 128))
    x = torch.randn(4, 128)
    y = row(F.silu(col(x)))
    try:
        if comm.rank == 0:
            y.float().sum().backward()
        else:
            with torch.no_grad():
                col(x)
        return "returned", row._dual.op is col.op
    except Exception as err:
        return type(err).__name__, row._dual.op is col.op


def test_a_skipped_fp8_backward_fails_its_peers_next_call_instead_of_pairing_with_it():
    """Before, rank 0's fp8 backward (the dual all-gather op, which the pool shares with the column
    layer's forward) paired with rank 1's next forward: rank 1's forward returned a wrong result
    (relative error ~1) with no error. Now the backward agrees its call first: both ranks raise."""
    outs = check_outcomes(spawn(_fp8_backward_skipped, world=2, timeout_s=90))
    assert outs[0][1] and outs[1][1]  # the shared op the fault needs
    assert outs[0][0] == "CommTimeoutError" and outs[1][0] == "CommTimeoutError", outs


def _replicated_input_grad(comm, mode):
    from cco.nn import ColumnParallelLinear, WindowPool

    torch.manual_seed(0)
    w, x0 = torch.randn(256, 128), torch.randn(8, 128)  # the whole weight: rank r holds rows r*128..
    col = ColumnParallelLinear(128, 128, group=comm, m_max=16, mode=mode, pool=WindowPool())
    col.load_weight(w[comm.rank * 128:(comm.rank + 1) * 128])
    x = x0.clone().requires_grad_(True)  # replicated: every rank's copy feeds every rank's columns
    gy = torch.randn(8, 256, generator=torch.Generator().manual_seed(1))  # the whole output's gradient
    col(x).float().mul(gy[:, comm.rank * 128:(comm.rank + 1) * 128]).sum().backward()
    ref = gy @ Q.dequantize_b(*Q.quantize_b(w, "ptpc"), "ptpc")  # d/dx of sum(gy * (x @ w.T))
    return Q.rel_l2(x.grad, ref)


@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_a_replicated_inputs_gradient_sums_every_ranks_columns(mode):
    """Before, ColumnParallelLinear without sequence parallelism returned this rank's term of the
    input's gradient (grad_y_r @ W_r) on each rank: relative error ~0.7 against the input's
    gradient, and every layer before it trained on a part of its gradient. Now its backward
    all-reduces it, as Megatron's column-parallel layer and torch's ColwiseParallel do."""
    for err in check_outcomes(spawn(_replicated_input_grad, world=2, args=(mode,), timeout_s=90)):
        assert err < 0.05, err
