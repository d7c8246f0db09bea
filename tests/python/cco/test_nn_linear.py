"""``cco.nn.RowParallelLinear`` on CPU ranks against the unfused model.

The unfused model of world W (``reference`` below): the full weight ``[N, K]`` split along K, each
rank's slice and input quantized as the layer's format prescribes (zero padding included), its
partial product in fp32 rounded to bf16, the partials summed in fp32, rounded to bf16, plus the bias.
Guards, per test: padding that is not zero or lands in the wrong place, a scale layout or weight
layout the kernel does not read, calls of more than ``m_max`` rows, an output that differs between
ranks, gradients that are not the unfused model's (or that would need communication), ranks that
take different paths, a shared window that mixes up two layers' weights, TP groups inside a larger
job.
"""

from __future__ import annotations

import os

import pytest
import torch

from cco import quant as Q
from cco.comm import check_outcomes, spawn
from tests.python.cco.cpu_ranks import torchrun_two_ranks

pytestmark = pytest.mark.multirank

DEADLINE_S = 20.0


def problem(n: int, k_total: int, lead=(3, 5), seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k_total, generator=g) * torch.exp2(torch.randint(-2, 3, (n, 1), generator=g).float())
    x = (torch.randn(*lead, k_total, generator=g)).to(torch.bfloat16)
    bias = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16)
    return w, x, bias


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    k = t.shape[-1] // world
    return t[..., rank * k:(rank + 1) * k]


def reference(w, x, bias, world: int, quant: str, n_padded: int, k_padded: int) -> torch.Tensor:
    n = w.shape[0]
    total = 0
    for r in range(world):
        xr, wr = shard(x, r, world), shard(w, r, world)
        k = xr.shape[-1]
        a, a_s = Q.quantize_a(torch.nn.functional.pad(xr.reshape(-1, k).float(), (0, k_padded - k)), quant)
        b, b_s = Q.quantize_b(torch.nn.functional.pad(wr.float(), (0, k_padded - k, 0, n_padded - n)), quant)
        total = total + Q.reference_gemm(a, b, a_s, b_s, quant).float()
    out = total.to(torch.bfloat16)[:, :n]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], n)


def float_model(w, x, bias) -> torch.Tensor:
    return (x.float() @ w.t() + (0 if bias is None else bias.float())).to(torch.bfloat16)


def _layer(comm, quant, n, k_total, *, bias=True, m_max=8, mode="fused", trainable=False, group=None):
    from cco.nn import RowParallelLinear

    layer = RowParallelLinear(k_total // comm.world, n, group=comm if group is None else group, quant=quant,
                              bias=bias, m_max=m_max, mode=mode, trainable=trainable, deadline_s=DEADLINE_S)
    return layer


# --------------------------------------------------------------------------------------------------
def _forward(comm, quant, n, k_total, mode):
    w, x, bias = problem(n, k_total)
    layer = _layer(comm, quant, n, k_total, mode=mode)
    layer.load_weight(shard(w, comm.rank, comm.world))
    with torch.no_grad():
        layer.bias.copy_(bias)
        y = layer(shard(x, comm.rank, comm.world))
    return y, repr(layer), layer.n_padded, layer.k_padded


CASES = [pytest.param(2, q, 200, 400, "fused", id=f"w2-{q}-pads-N-and-K") for q in Q.QUANTS]
CASES += [pytest.param(3, "ptpc", 384, 3 * 256, "fused", id="w3-ptpc-unpadded"),
          pytest.param(2, "blockscale", 200, 400, "unfused", id="w2-blockscale-unfused")]


@pytest.mark.parametrize("world, quant, n, k_total, mode", CASES)
def test_forward_is_the_unfused_model(world, quant, n, k_total, mode):
    """15 rows through m_max=8 (two calls), leading shape (3, 5), bias; padded N and K where the
    shape needs them: every rank returns the same bytes, within the op's budget of the quantized
    reference and within fp8's error of the float model."""
    outs = check_outcomes(spawn(_forward, world=world, args=(quant, n, k_total, mode), timeout_s=180))
    y, text, n_padded, k_padded = outs[0]
    for other in outs[1:]:
        assert torch.equal(other[0], y)
    w, x, bias = problem(n, k_total)
    ref = reference(w, x, bias, world, quant, n_padded, k_padded)
    assert y.shape == (3, 5, n) and y.dtype == torch.bfloat16
    assert Q.count_mismatches(y, ref) == 0 and Q.rel_l2(y, ref) < Q.REL_L2_TOL[quant]
    assert Q.rel_l2(y, float_model(w, x, bias)) < 0.1  # fp8 operands: a few percent
    if mode == "fused":
        assert "path=fused" in text and "window" in text
        assert (n_padded > n) == ("padded N" in text)
    else:
        assert "path=unfused (mode='unfused' was asked for)" in text and "window" not in text


# --------------------------------------------------------------------------------------------------
def _one_rank_refuses(comm):
    """Rank 1's backend refuses the shape (its plan carries a reason); rank 0's accepts."""
    from cco import shapes
    from cco.nn import linear

    real = shapes.layer_shape

    def refusing(*args, **kw):
        plan = real(*args, **kw)
        return shapes.LayerShape(**{**plan.__dict__, "reason": "cpu: refused on this rank (test)"})

    if comm.rank == 1:
        linear.shapes.layer_shape = refusing
    w, x, bias = problem(256, 512)
    layer = _layer(comm, "ptpc", 256, 512, m_max=16)
    layer.load_weight(shard(w, comm.rank, comm.world))
    with torch.no_grad():
        layer.bias.copy_(bias)
        return layer(shard(x, comm.rank, comm.world)), layer.fallback_reason, layer.op is None


def test_one_rank_refusing_sends_every_rank_down_the_unfused_path():
    """A backend verdict that differs between ranks becomes one verdict: every rank runs unfused,
    names the rank that refused, and returns the unfused model. With per-rank verdicts rank 0 would
    run the op while rank 1 all-reduces, and neither returns."""
    outs = check_outcomes(spawn(_one_rank_refuses, world=2, timeout_s=120))
    w, x, bias = problem(256, 512)
    ref = reference(w, x, bias, 2, "ptpc", 256, 256)
    for y, reason, unfused in outs:
        assert unfused and reason == "rank 1: cpu: refused on this rank (test)"
        assert Q.count_mismatches(y, ref) == 0


# --------------------------------------------------------------------------------------------------
def _loads(comm, quant, n, k):
    from cco.nn import RowParallelLinear

    w = problem(n, k)[0]
    a = RowParallelLinear(k, n, group=comm, quant=quant, m_max=8)
    b = RowParallelLinear(k, n, group=comm, quant=quant, m_max=8)
    a.load_weight(w)
    # a checkpoint shard: quantized with the format's blocks over the zero-padded K, stored unpadded
    kb = {"ptpc": k, "blockscale": -(-k // Q.SCALE_BLOCK) * Q.SCALE_BLOCK, "mxfp8": -(-k // Q.MX_GROUP) * Q.MX_GROUP}
    q, s = Q.quantize_b(torch.nn.functional.pad(w, (0, kb[quant] - k)), quant)
    b.load_fp8(q[:, :k].contiguous(), s)
    # the same e4m3 bytes (zero padding included) and the same weight; the scales of the padding may
    # differ (one here, the quantizer's all-zero scale there): they multiply zeros
    same = torch.equal(a.qweight.view(torch.uint8), b.qweight.view(torch.uint8)) and torch.equal(
        a.dequantized_weight(), b.dequantized_weight())
    errors = []
    for bad in (lambda: b.load_fp8(q[:, :k].float(), s), lambda: b.load_fp8(q[:, :k - 1], s),
                lambda: b.load_fp8(q[:, :k].contiguous(), s[:1]), lambda: a.load_weight(w.to(Q.FP8)),
                lambda: a(torch.zeros(2, k + 1))):
        try:
            bad()
            errors.append(None)
        except (TypeError, ValueError) as err:
            errors.append(str(err))
    return same, errors, (a.window_bytes, repr(a))


@pytest.mark.parametrize("quant", Q.QUANTS)
def test_fp8_checkpoint_shard_loads_like_its_float_source(quant):
    """K = 200 per rank: blockscale's and mxfp8's last block is partial in the checkpoint; padded
    with zero weights whose scales are one, the stored operands equal the float load's."""
    (same, errors, (window, text)), = check_outcomes(spawn(_loads, world=1, args=(quant, 256, 200), timeout_s=60))
    assert same
    # one rank: the layer's op publishes nothing, so its window holds words alone (cco.layout.publishes)
    assert window < 16 << 10 and f"window {window / 1024:.1f} KiB shared by" in text, (window, text)
    expect = ["float8_e4m3fn", "[256, 200]", "w_scale", "load_fp8", "in_features_per_rank=200"]
    for err, word in zip(errors, expect):
        assert err is not None and word in err, (err, word)


# --------------------------------------------------------------------------------------------------
def _gradients(comm, quant, trainable):
    n, k_total = 200, 400
    w, x, bias = problem(n, k_total, lead=(2, 7), seed=4)
    layer = _layer(comm, quant, n, k_total, trainable=trainable)
    layer.load_weight(shard(w, comm.rank, comm.world))
    with torch.no_grad():
        layer.bias.copy_(bias)
    xr = shard(x, comm.rank, comm.world).clone().requires_grad_(True)
    w_used = layer.dequantized_weight(*layer.quantized_weight())  # trainable: the master weight requantized
    y = layer(xr)
    g = torch.Generator().manual_seed(9)
    grad_y = torch.randn(y.shape, generator=g).to(torch.bfloat16)
    y.backward(grad_y)
    return (xr.grad, None if layer.weight is None else layer.weight.grad, layer.bias.grad, w_used, grad_y,
            layer.training)


@pytest.mark.parametrize("quant, trainable", [("ptpc", True), ("blockscale", False), ("mxfp8", True)])
def test_gradients_are_the_unfused_models(quant, trainable):
    """Backward against torch autograd through the unfused model (full weight, fp32): every rank's
    input gradient is ``grad_y @ W_r`` for the weight the forward used, its master weight's
    ``grad_y.T @ x_r``, the bias gradient ``grad_y`` summed; no rank needs another's data."""
    world = 2
    outs = check_outcomes(spawn(_gradients, world=world, args=(quant, trainable), timeout_s=180))
    n, k_total = 200, 400
    w, x, bias = problem(n, k_total, lead=(2, 7), seed=4)
    grad_y = outs[0][4]
    w_full = torch.cat([o[3] for o in outs], dim=1).requires_grad_(True)  # [N, K]: each rank's dequantized W_r
    x_full = x.float().requires_grad_(True)
    b = bias.float().requires_grad_(True)
    (x_full @ w_full.t() + b).backward(grad_y.float())
    for rank, (gx, gw, gb, _, _, training) in enumerate(outs):
        assert training
        assert gx.dtype == torch.bfloat16 and gx.shape == (2, 7, k_total // world)
        assert Q.rel_l2(gx, shard(x_full.grad, rank, world)) < 1e-2
        assert Q.rel_l2(gb, b.grad) < 1e-2
        if trainable:
            assert gw.shape == (n, k_total // world)
            assert Q.rel_l2(gw, shard(w_full.grad, rank, world)) < 1e-2
        else:
            assert gw is None


# --------------------------------------------------------------------------------------------------
def _tp_dp(comm):
    import torch.distributed as dist

    from tests.python.cco.test_comm import _tp_dp as groups

    tp_group, dp_group = groups(comm, 2)
    tp_rank, dp_rank = comm.rank % 2, comm.rank // 2
    n, k_total = 256, 512
    w, _, bias = problem(n, k_total)
    w = w.to(torch.bfloat16)  # a bf16 master weight, requantized in every training forward
    x = problem(n, k_total, lead=(6,), seed=10 + dp_rank)[1]  # each DP replica its own batch
    from cco.nn import RowParallelLinear

    layer = RowParallelLinear(k_total // 2, n, group=tp_group, quant="ptpc", bias=True, m_max=8, trainable=True,
                              deadline_s=DEADLINE_S)
    layer.load_weight(shard(w, tp_rank, 2))
    with torch.no_grad():
        layer.bias.copy_(bias)
    y = layer(shard(x, tp_rank, 2))
    y.float().square().sum().backward()
    grad_w = layer.weight.grad.float()
    dist.all_reduce(grad_w, group=dp_group)  # data parallel: the replicas' gradients summed
    return y.detach(), grad_w, layer.comm.rank, layer.comm.world, repr(layer)


def test_tp2_by_dp2_on_four_ranks():
    """Two TP groups of two ranks, each with its own window and its own batch; the DP groups sum
    the TP ranks' weight gradients. Each TP group's output is the unfused model of its batch; the
    summed gradient of each weight shard is the unfused model's over both batches."""
    outs = check_outcomes(spawn(_tp_dp, world=4, timeout_s=240))
    n, k_total = 256, 512
    w, _, bias = problem(n, k_total)
    w = w.to(torch.bfloat16).float()
    grads = 0
    for dp_rank in range(2):
        x = problem(n, k_total, lead=(6,), seed=10 + dp_rank)[1]
        ref = reference(w, x, bias, 2, "ptpc", 256, 256)
        for tp_rank in range(2):
            y, _, rank, world, text = outs[2 * dp_rank + tp_rank]
            assert (rank, world) == (tp_rank, 2) and "rank=%d/2" % tp_rank in text
            assert Q.count_mismatches(y, ref) == 0
        grads = grads + (2 * ref.float()).t() @ x.float()  # d(sum y^2)/dW = (2 y).T @ x
    for rank, (_, grad_w, *_) in enumerate(outs):
        assert Q.rel_l2(grad_w, shard(grads, rank % 2, 2)) < 2e-2


# --------------------------------------------------------------------------------------------------
def _shared(comm):
    from cco.nn import RowParallelLinear, WindowPool

    pool = WindowPool()
    n, k = 256, 256
    make = lambda n_out, quant="ptpc": RowParallelLinear(k, n_out, group=comm, quant=quant, m_max=8,  # noqa: E731
                                                         pool=pool, deadline_s=DEADLINE_S)
    a, b, c = make(n), make(n), make(2 * n)
    ws = [problem(layer.out_features, k * comm.world, seed=s)[0] for s, layer in enumerate((a, b, c))]
    for layer, w in zip((a, b, c), ws):
        layer.load_weight(shard(w, comm.rank, comm.world))
    x = shard(problem(n, k * comm.world, lead=(5,), seed=7)[1], comm.rank, comm.world)
    with torch.no_grad():
        ys = [layer(x) for layer in (a, b, c, a)]  # a, then b on the same op, then a again
    facts = {"a_is_b": a.op is b.op, "a_is_c": a.op is c.op, "repr": repr(a), "users_before": pool.users(a.op)}
    op = a.op
    a.close()
    facts["users_after"] = pool.users(op)
    facts["open_after_one"] = not op._closed
    b.close()
    facts["closed_after_both"] = op._closed
    try:
        a(x)
        facts["closed_call"] = None
    except RuntimeError as err:
        facts["closed_call"] = str(err)
    with torch.no_grad():
        empty = c(x[:0])
    c.close()
    pool.close()
    return ys, ws, facts, empty


def test_layers_of_one_shape_share_one_window():
    """Two layers of one shape take turns on one op (one window, its size in repr), a third shape
    gets its own; outputs follow each layer's own weight; the window goes with its last layer; a
    closed layer refuses calls; an empty batch returns [0, N] on every rank without a call."""
    outs = check_outcomes(spawn(_shared, world=2, timeout_s=180))
    ys, ws, facts, empty = outs[0]
    x = problem(256, 512, lead=(5,), seed=7)[1]
    for y, w in zip(ys, ws + [ws[0]]):
        assert Q.count_mismatches(y, reference(w, x, None, 2, "ptpc", w.shape[0], 256)) == 0
    for _, _, f, e in outs:
        assert f["a_is_b"] and not f["a_is_c"]
        assert "window 0.1 MiB shared by 2 layer(s)" in f["repr"] and f["users_before"] == 2
        assert f["users_after"] == 1 and f["open_after_one"] and f["closed_after_both"]
        assert "closed" in f["closed_call"]
        assert e.shape == (0, 512)


# --------------------------------------------------------------------------------------------------
BAD_INPUTS = {  # what rank 1 passes instead of its slice: (the error it raises, a word of its message)
    "one feature too few": ("ValueError", "features"),
    "0-d": ("ValueError", "0-d"),
    "int32": ("TypeError", "torch.int32"),
    "fp8": ("TypeError", "float8_e4m3fn"),
    "not a tensor": ("TypeError", "torch.Tensor"),
}


def _bad(kind, xs):
    return {"one feature too few": lambda: xs[:, :-1], "0-d": lambda: xs[0, 0],
            "int32": lambda: xs.to(torch.int32), "fp8": lambda: xs.to(torch.float8_e4m3fn),
            "not a tensor": lambda: xs.tolist()}[kind]()


def _one_rank_passes_a_bad_input(comm):
    """Per bad input: (this rank's verdict on the call where rank 1 passes it, the next call's output)."""
    from cco.transport.protocol import PeerRejectedError

    w, x, bias = problem(256, 512, lead=(4,))
    layer = _layer(comm, "ptpc", 256, 512, bias=False)
    layer.load_weight(shard(w, comm.rank, comm.world))
    xs = shard(x, comm.rank, comm.world)
    found = {}
    for kind in BAD_INPUTS:
        first = _bad(kind, xs) if comm.rank == 1 else xs
        try:
            with torch.no_grad():
                layer(first)
            verdict = "returned"
        except PeerRejectedError as err:
            verdict = f"PeerRejectedError: {err}"
        except (TypeError, ValueError) as err:
            verdict = f"{type(err).__name__}: {err}"
        with torch.no_grad():
            found[kind] = verdict, layer(xs)  # the ranks are still in step: the next call is good everywhere
    return found


def test_a_rank_whose_input_the_layer_rejects_fails_the_call_on_every_rank():
    """Guards: a layer whose own input check raises on one rank before it reaches the op. Without
    taking part in the call, the peer waits out its deadline and the ranks' calls fall out of
    step (the next call pairs different calls or fails too); with the rejection the peer raises
    PeerRejectedError naming rank 1 at once and the next call is correct on both ranks. A 0-d
    input raised IndexError and a list TypeError before the check (no rejection: the peer's call
    paired with rank 1's next one and returned its result), and int32 and fp8 inputs ran, fp8's
    bytes read as their values (a caller's pre-quantized rows lost their scales with no word)."""
    outs = check_outcomes(spawn(_one_rank_passes_a_bad_input, world=2, timeout_s=120))
    w, x, _ = problem(256, 512, lead=(4,))
    ref = reference(w, x, None, 2, "ptpc", 256, 256)
    for kind, (error, word) in BAD_INPUTS.items():
        (verdict0, second0), (verdict1, second1) = outs[0][kind], outs[1][kind]
        assert verdict1.startswith(error) and word in verdict1, (kind, verdict1)
        assert verdict0.startswith("PeerRejectedError") and "rank 1" in verdict0, (kind, verdict0)
        assert Q.count_mismatches(second0, ref) == 0 and torch.equal(second0, second1), kind


# --------------------------------------------------------------------------------------------------
# the unfused path's header, and calls of no rows: one verdict on every rank
def _unfused_faults(comm):
    """Per case, this rank's verdict ("ok", or the error's type and first line) on the faulty
    call, and whether the next good call is right (the ranks still in step)."""
    from cco.nn import ColumnParallelLinear, RowParallelLinear, WindowPool

    torch.manual_seed(0)
    w, x = torch.randn(256, 512), torch.randn(8, 512)
    ref_row = x @ w.t()
    pool = WindowPool()
    row = RowParallelLinear(256, 256, group=comm, quant="ptpc", m_max=8, mode="unfused", pool=pool, deadline_s=10)
    row.load_weight(w[:, comm.rank * 256:(comm.rank + 1) * 256])
    sp_row = RowParallelLinear(256, 256, group=comm, quant="ptpc", m_max=8, mode="unfused", sequence_parallel=True,
                               pool=pool, deadline_s=10)
    sp_row.load_weight(w[:, comm.rank * 256:(comm.rank + 1) * 256])
    col = ColumnParallelLinear(512, 128, group=comm, quant="ptpc", m_max=8, mode="unfused", sequence_parallel=True,
                               pool=pool, deadline_s=10)
    col.load_weight(w[comm.rank * 128:(comm.rank + 1) * 128])
    xr = x[:, comm.rank * 256:(comm.rank + 1) * 256]
    good = {"row": (row, xr, ref_row), "sp row": (sp_row, xr, ref_row[comm.rank * 4:(comm.rank + 1) * 4]),
            "column": (col, x[comm.rank * 4:(comm.rank + 1) * 4], x @ w[comm.rank * 128:(comm.rank + 1) * 128].t())}
    one = comm.rank == 1
    cases = {  # (layer, what this rank passes)
        "row: rank 1 one feature short": ("row", xr[:, :-1] if one else xr),
        "row: rank 1 other rows": ("row", xr[:6] if one else xr),
        "row: rank 1 no rows": ("row", xr[:0] if one else xr),
        "row: rank 1 in two pieces": ("row", torch.cat([xr, xr]) if one else xr),  # 16 rows: two calls of 8
        "sp row: rank 1 other rows": ("sp row", xr[:6] if one else xr),
        "column: rank 1 other rows": ("column", good["column"][1][:2] if one else good["column"][1]),
        "column: rank 1 int32": ("column", good["column"][1].int() if one else good["column"][1]),
    }
    found = {}
    with torch.no_grad():
        for case, (name, bad) in cases.items():
            layer, xg, ref = good[name]
            try:
                layer(bad)
                verdict = "ok"
            except Exception as err:
                verdict = f"{type(err).__name__}: {str(err).splitlines()[0]}"
            found[case] = (verdict, Q.rel_l2(layer(xg), ref) < 0.1)
        found["row: no rows anywhere"] = (tuple(row(xr[:0]).shape), Q.rel_l2(row(xr), ref_row) < 0.1)
    for layer in (row, sp_row, col):
        layer.close()
    return found


def test_the_unfused_path_agrees_its_rows_before_its_collective():
    """The unfused path (``mode="unfused"``, and every layer a backend refuses) ran torch's
    collectives straight, which check no sizes. Before, rank 1's input refused by the layer (one
    feature short, int32) raised there alone and rank 0's call paired with rank 1's next call,
    returning its result; other rows, or none, aborted the gloo job ("Received data size doesn't
    match") or paired calls; a call of 16 rows in two pieces against one of 8 paired its first
    piece. Now a header goes first (every rank's rows, the forward's total, a refusal) and every
    rank raises, and the next call is right."""
    outs = check_outcomes(spawn(_unfused_faults, world=2, timeout_s=180))
    expect = {
        "row: rank 1 one feature short": ("ValueError: RowParallelLinear: x has 255 features", "PeerRejectedError"),
        "row: rank 1 other rows": ("PeerMismatchError", "PeerMismatchError"),
        "row: rank 1 no rows": ("PeerMismatchError", "PeerMismatchError"),
        "row: rank 1 in two pieces": ("PeerMismatchError", "PeerMismatchError"),
        "sp row: rank 1 other rows": ("PeerMismatchError", "PeerMismatchError"),
        "column: rank 1 other rows": ("PeerMismatchError", "PeerMismatchError"),
        "column: rank 1 int32": ("TypeError: ColumnParallelLinear: x is torch.int32", "PeerRejectedError"),
    }
    for case, (on_rank1, on_rank0) in expect.items():
        for rank, prefix in ((0, on_rank0), (1, on_rank1)):
            verdict, next_right = outs[rank][case]
            assert verdict.startswith(prefix), (case, rank, verdict)
            assert next_right, (case, rank)
    for rank in (0, 1):
        assert outs[rank]["row: rank 1 other rows"][0].endswith("every rank must pass the same tokens")
        assert "8 (a piece of 16) on rank 1" in outs[1]["row: rank 1 in two pieces"][0]
        assert outs[rank]["row: no rows anywhere"] == ((0, 256), True)


def _fused_empty_on_one_rank(comm):
    from cco.nn import RowParallelLinear, WindowPool

    torch.manual_seed(0)
    w, x = torch.randn(256, 512), torch.randn(8, 512)
    layer = RowParallelLinear(256, 256, group=comm, quant="ptpc", m_max=8, pool=WindowPool(), deadline_s=4)
    layer.load_weight(w[:, comm.rank * 256:(comm.rank + 1) * 256])
    xr = x[:, comm.rank * 256:(comm.rank + 1) * 256]
    found = {}
    with torch.no_grad():
        found["no rows anywhere"] = tuple(layer(xr[:0]).shape)
        pieces = torch.cat([xr, xr, xr])  # 24 rows: three pieces of m_max = 8
        found["pieces alike"] = Q.rel_l2(layer(pieces[:16]), torch.cat([x @ w.t()] * 2)) < 0.1
        for case, mine in (("16 rows against 24, in pieces", pieces[:24] if comm.rank == 1 else pieces[:16]),
                           ("no rows against 8", xr[:0] if comm.rank == 1 else xr),
                           ("16 rows in pieces against 8", pieces[:16] if comm.rank == 1 else xr)):
            try:
                layer(mine)
                found[case] = "ok"
            except Exception as err:
                found[case] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return found


def test_a_fused_forward_of_no_rows_or_in_pieces_is_agreed_on_every_rank():
    """Before, a rank with no rows skipped the call (nothing to reduce) while its peer called the
    op, and a forward of 16 rows (two op calls of m_max = 8) met a peer's forward of 8: either way
    the peer's call paired with another call of this rank and returned its result (the op's stamps
    compare one call's rows). Now a forward of no rows or in pieces agrees its rows first: where
    every rank has none each returns [0, N]; forwards in pieces of other totals raise
    PeerMismatchError on both ranks; against a peer's single op call the header times out after
    deadline_s and takes part in the op call as a rejected one (which fails on the peer by that
    rejection or its own timeout); nothing is returned."""
    outs = check_outcomes(spawn(_fused_empty_on_one_rank, world=2, timeout_s=180))
    for rank, found in enumerate(outs):
        assert found["no rows anywhere"] == (0, 256) and found["pieces alike"], (rank, found)
        assert found["16 rows against 24, in pieces"].startswith("PeerMismatchError"), (rank, found)
        assert "8 (a piece of 16) on rank 0, 8 (a piece of 24) on rank 1" in found["16 rows against 24, in pieces"]
        for case in ("no rows against 8", "16 rows in pieces against 8"):  # (rank 1's header, rank 0's op call)
            allowed = ("CommTimeoutError", "PeerRejectedError") if rank == 0 else ("CommTimeoutError",)
            assert found[case].startswith(allowed), (rank, case, found[case])


def _header_against_a_later_op_call(comm, kind, case):
    """Rank 1's forward goes through the call's header (no rows, or pieces) at once; rank 0 calls
    the op with 8 rows a second later (deadline 3 s): rank 1's header times out before rank 0's op
    call does. Then both call again with rows of their own. Each rank's two verdicts."""
    import time

    from cco.nn import ColumnParallelLinear, RowParallelLinear, WindowPool

    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g)
    xs = [torch.randn(8, 512, generator=g).to(torch.bfloat16) for _ in range(2)]
    r, pool = comm.rank, WindowPool()
    if kind == "column, sequence parallel":  # this rank's 4 of the 8 tokens in, every token's N/2 columns out
        layer = ColumnParallelLinear(512, 128, group=comm, quant="ptpc", m_max=8, sequence_parallel=True, pool=pool,
                                     deadline_s=3)
        layer.load_weight(w[r * 128:(r + 1) * 128])
        mine = [x[r * 4:(r + 1) * 4] for x in xs]
        want = [x.float() @ w[r * 128:(r + 1) * 128].t() for x in xs]
    else:  # this rank's K slice in; every row (or, sequence parallel, this rank's 4 rows) out
        sp = kind == "row, sequence parallel"
        layer = RowParallelLinear(256, 256, group=comm, quant="ptpc", m_max=8, sequence_parallel=sp, pool=pool,
                                  deadline_s=3)
        layer.load_weight(w[:, r * 256:(r + 1) * 256])
        mine = [x[:, r * 256:(r + 1) * 256] for x in xs]
        want = [(x.float() @ w.t())[r * 4:(r + 1) * 4] if sp else x.float() @ w.t() for x in xs]
    found = []
    with torch.no_grad():
        for call in range(2):
            x = mine[call]
            if call == 0 and r == 1:
                x = x[:0] if case == "no rows" else torch.cat([x, x])  # pieces: more than m_max rows
            elif call == 0:
                time.sleep(1.0)
            try:
                y = layer(x)
                found.append(("returned", bool(Q.rel_l2(y, want[call]) < 0.1)))
            except Exception as err:
                found.append((type(err).__name__, str(err).splitlines()[0][:160]))
    layer.close()
    return found


@pytest.mark.parametrize("kind, case", [("row", "no rows"), ("row", "pieces"), ("row, sequence parallel", "no rows"),
                                        ("column, sequence parallel", "no rows")])  # (SP calls are never in pieces)
def test_a_header_that_times_out_takes_part_in_the_peers_op_call(kind, case):
    """Before, a rank whose header timed out (its peer called the op instead) raised, and its next
    call took the seq of the peer's still waiting op call: both returned a mix of two calls (the
    peer's first call against this rank's second, this rank's second against nothing of its own).
    Now the rank whose header timed out takes part in that op call as a rejected one: the peer's
    call fails (PeerRejectedError, or its own timeout), nothing is returned, and the next call is
    right on both ranks."""
    outs = check_outcomes(spawn(_header_against_a_later_op_call, world=2, args=(kind, case), timeout_s=120))
    assert outs[1][0][0] == "CommTimeoutError", outs
    assert outs[0][0][0] in ("PeerRejectedError", "CommTimeoutError"), outs
    assert [found[1] for found in outs] == [("returned", True)] * 2, outs


def _after_a_timed_out_header(comm, case):
    """A call whose header times out on rank 1, then the same three forwards on both ranks, each
    through a header (16 rows in pieces of m_max 8). ``case``: "rows against none" (rank 1's call
    has no rows, rank 0's 8: rank 0 never makes that header; which rank's wait ends first: see the
    test), or "late peer" (the same call on both, rank 0 past rank 1's deadline; fused or
    unfused). Each rank's verdicts, call by call."""
    import time

    from cco.nn import RowParallelLinear, WindowPool

    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g)
    xs = [torch.randn(16, 512, generator=g).to(torch.bfloat16) for _ in range(3)]
    r = comm.rank
    layer = RowParallelLinear(256, 256, group=comm, quant="ptpc", m_max=8, pool=WindowPool(), deadline_s=3,
                              mode="unfused" if case.endswith("unfused") else "fused")
    layer.load_weight(w[:, r * 256:(r + 1) * 256])
    found = []
    with torch.no_grad():
        first = xs[0][:, r * 256:(r + 1) * 256]
        if case.startswith("rows against none"):
            first = first[:0] if r == 1 else first[:8]
            # which rank's wait ends first: rank 1's header (its peer starts 0.5 s later), or rank 0's
            # op call (", the op call ends first": rank 1 starts 0.5 s later)
            if r == (1 if case.endswith("ends first") else 0):
                time.sleep(0.5)
        elif r == 0:
            time.sleep(4.5)  # past rank 1's header deadline, then the same call
        for x, want in [(first, None)] + [(x[:, r * 256:(r + 1) * 256], x.float() @ w.t()) for x in xs]:
            try:
                y = layer(x)
                found.append(("returned", want is None or bool(Q.rel_l2(y, want) < 0.1)))
            except Exception as err:
                found.append((type(err).__name__, str(err).splitlines()[0][:400]))
    layer.close()
    return found


@pytest.mark.parametrize("case", ["rows against none", "rows against none, the op call ends first", "late peer",
                                  "late peer, unfused"])
def test_the_ranks_are_in_step_again_after_a_timed_out_header(case):
    """A header that times out leaves its gather posted on the communicator's group, and the peers'
    next header met it. Before, that paired every later header of one rank with the next call's of
    the other: forwards in pieces returned results that mixed two calls, on both ranks, with no
    error (rows against none). Then an exchange carried its call's seq, this rank's next header
    completed the stale gather first, and both ranks' next calls failed (PeerMismatchError); now
    the peers see this rank behind and post their header again, which its next header meets: the
    calls after the failed one are right on both ranks.

    "the op call ends first": rank 0's op call (rows) ends at its deadline before rank 1's header
    (no rows, entered later) does, and rank 0's next header meets rank 1's first one. Before, both
    raised PeerMismatchError and rank 1 never took part in rank 0's failed op call: their op seqs
    stayed one apart, and every later call failed on both. Now rank 1 (behind) takes part in that
    call as a rejected one and raises, rank 0 posts its header again, and the calls after are right.

    "late peer": the same call on both, rank 0 past rank 1's deadline. The late peer completed the
    stale gather and went on into the call: on the fused path its op call met rank 1's rejected one
    (PeerRejectedError); on the unfused path it entered the all-reduce alone and met rank 1's next
    header there (gloo paired the two: "Connection closed by peer" on both, the group lost). Now the
    exchange carries when each rank entered it, and a rank entering past the timeout's late bound
    fails it on every rank that gets the words (CommTimeoutError on both ranks)."""
    outs = check_outcomes(spawn(_after_a_timed_out_header, world=2, args=(case,), timeout_s=150))
    if case == "rows against none":
        assert outs[1][0][0] == "CommTimeoutError", outs  # rank 1's header waited out its deadline
        assert outs[0][0][0] in ("PeerRejectedError", "CommTimeoutError"), outs
        # rank 1's inputs were not the reason: its own header had timed out
        assert outs[0][0][0] != "PeerRejectedError" or "a call of its own having failed first" in outs[0][0][1], outs
    elif case.endswith("ends first"):
        assert outs[0][0][0] == "CommTimeoutError", outs  # rank 0's op call waited out its deadline
        assert outs[1][0][0] == "PeerMismatchError" and "1 call(s) behind" in outs[1][0][1], outs
    else:
        assert outs[1][0][0] == "CommTimeoutError", outs
        assert outs[0][0][0] == "CommTimeoutError" and "entered this exchange" in outs[0][0][1], outs
    assert [found[1:] for found in outs] == [[("returned", True)] * 3] * 2, outs


EXIT_SCRIPT = '''
import atexit, os, sys
def threads():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
# first in: runs after cco's handlers; one write per rank, so the two ranks' lines do not interleave
atexit.register(lambda: os.write(1, f"at exit: {threads()}\\n".encode()))
import torch, torch.distributed as dist
from cco.nn import RowParallelLinear, close_layers
dist.init_process_group("gloo")
layer = RowParallelLinear(256, 128, group=dist.group.WORLD, quant="ptpc", m_max=16, mode=sys.argv[1])
layer.load_weight(torch.randn(128, 256, dtype=torch.bfloat16))
layer(torch.randn(4, 256, dtype=torch.bfloat16))
close_layers(layer)
dist.destroy_process_group()  # the job's own group, destroyed; the layer is still referenced here
'''


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads thread names in /proc (Linux)")
@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_a_job_that_closes_its_layers_and_destroys_its_group_leaves_no_gloo_worker_at_exit(tmp_path, mode):
    """A job's layer on the group it created, closed, then the group destroyed: at interpreter exit no
    gloo worker of that group runs any more (a worker left into the interpreter's finalization can
    abort the process there: docs/experiments.md, "the exit-time abort, its holders"). Fails with the
    closed layer still holding its group, or the pool's communicator holding it to exit (checked)."""
    script = tmp_path / "job.py"
    script.write_text(EXIT_SCRIPT)
    proc = torchrun_two_ranks(script, mode, timeout_s=180)
    seen = [line for line in proc.stdout.splitlines() if line.startswith("at exit:")]
    assert len(seen) == 2, proc.stdout
    for line in seen:
        assert "gloo" not in line, line


# --------------------------------------------------------------------------------------------------
# two layers of one family (one op in the pool): the ranks must call the same layer
LAYER_KINDS = ("row", "row, sequence parallel", "column, sequence parallel")


def _two_layers(comm, kind, mode, pools, w_a, w_b, deadline_s):
    """Two layers of ``kind`` of one shape, the first in ``pools[0]``, the second in ``pools[1]`` (one
    pool, fused: one op for both), with weights ``w_a`` and ``w_b`` [256, 512], and a function from a
    full input [8, 512] to this rank's input."""
    from cco.nn import ColumnParallelLinear, RowParallelLinear

    r = comm.rank
    layers = []
    for w, pool in zip((w_a, w_b), pools):
        if kind == "column, sequence parallel":
            layer = ColumnParallelLinear(512, 128, group=comm, quant="ptpc", m_max=8, sequence_parallel=True,
                                         mode=mode, pool=pool, deadline_s=deadline_s)
            layer.load_weight(w[r * 128:(r + 1) * 128])
        else:
            layer = RowParallelLinear(256, 256, group=comm, quant="ptpc", m_max=8, mode=mode, pool=pool,
                                      sequence_parallel=kind == "row, sequence parallel", deadline_s=deadline_s)
            layer.load_weight(w[:, r * 256:(r + 1) * 256])
        layers.append(layer)
    if kind == "column, sequence parallel":
        return layers, lambda x: x[r * 4:(r + 1) * 4], lambda y: y
    sp = kind == "row, sequence parallel"
    return layers, lambda x: x[:, r * 256:(r + 1) * 256], (lambda y: y[r * 4:(r + 1) * 4]) if sp else (lambda y: y)


def _ranks_call_different_layers(comm, kind, mode, pools=1):
    """Rank 0 calls layer a, rank 1 layer b (same shape; one family, or ``pools=2``: each in a pool
    of its own), then both call a, then b: this rank's verdict on the mixed call ("returned" and its
    error against either layer's product, or the error) and whether the two calls after it are right."""
    from cco.nn import WindowPool

    g = torch.Generator().manual_seed(0)
    w_a, w_b = torch.randn(256, 512, generator=g), torch.randn(256, 512, generator=g)
    x = torch.randn(8, 512, generator=g).to(torch.bfloat16)
    pool = WindowPool()
    (a, b), mine, share = _two_layers(comm, kind, mode, [pool, pool if pools == 1 else WindowPool()], w_a, w_b,
                                      deadline_s=10)
    if kind == "column, sequence parallel":
        want = {"a": x.float() @ w_a[comm.rank * 128:(comm.rank + 1) * 128].t(),
                "b": x.float() @ w_b[comm.rank * 128:(comm.rank + 1) * 128].t()}
    else:
        want = {"a": share(x.float() @ w_a.t()), "b": share(x.float() @ w_b.t())}
    with torch.no_grad():
        try:
            y = (a if comm.rank == 0 else b)(mine(x))
            if a.op is not None:
                a.op.check()  # an asynchronous backend raises a peer's mismatch here at the latest
            verdict = f"returned (rel. error {min(Q.rel_l2(y, t) for t in want.values()):.2f})"
        except Exception as err:
            verdict = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        after = [bool(Q.rel_l2(a(mine(x)), want["a"]) < 0.1), bool(Q.rel_l2(b(mine(x)), want["b"]) < 0.1)]
    shared = a.op is not None and a.op is b.op
    a.close()
    b.close()
    return verdict, after, shared


@pytest.mark.parametrize("mode, pools", [("fused", 1), ("unfused", 1), ("unfused", 2)],
                         ids=["fused", "unfused", "unfused, two pools"])
@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_ranks_calling_different_layers_raise_on_every_rank(kind, mode, pools):
    """Guards: two layers of one shape share their op (``WindowPool``: one window for the family),
    so their calls take seqs of one count. Rank 0 calling layer a while rank 1 calls layer b (a
    rank's control flow that skipped a layer, or took the layers in another order) paired the
    two calls: the op's stamps compared (seq, M) only, the unfused header rows only, and both
    ranks returned a sum of two layers' products (1250 of 1280 outputs off) with no error. Each
    call now carries its layer's tag (the layer's place among the group's layers, agreed at
    construction) in the stamp and the header: both ranks raise PeerMismatchError naming the
    layers, and the next calls are right.

    ``pools=2``: the unfused layers each in a pool of their own on one group. The tags and the
    unfused headers' seq were counted per pool, so their first layers had one tag and their calls
    one header seq, and the two calls' headers paired with no error; they are counted per group."""
    outs = check_outcomes(spawn(_ranks_call_different_layers, world=2, args=(kind, mode, pools), timeout_s=120))
    for rank, (verdict, after, shared) in enumerate(outs):
        assert shared == (mode == "fused"), (rank, shared)
        assert verdict.startswith("PeerMismatchError") and "layer" in verdict, (rank, verdict)
        assert after == [True, True], (rank, after)


def _peer_calls_a_layer_closed_here(comm, kind):
    """Two fused layers of one family (one op); rank 1 closes layer a, the op staying open for b;
    rank 0 then calls a. Rank 0's verdict (its error's type, first line and notes, and the seconds
    it took), rank 1's "closed"; both meet at a barrier after."""
    import time

    from cco.nn import WindowPool

    g = torch.Generator().manual_seed(0)
    w_a, w_b = torch.randn(256, 512, generator=g), torch.randn(256, 512, generator=g)
    x = torch.randn(8, 512, generator=g).to(torch.bfloat16)
    (a, b), mine, _ = _two_layers(comm, kind, "fused", [WindowPool()] * 2, w_a, w_b, deadline_s=2)
    assert a.op is b.op and a.op is not None
    verdict = "closed"
    with torch.no_grad():
        b(mine(x))  # a call of the family, on both ranks
        if comm.rank == 1:
            a.close()
        comm.barrier()
        if comm.rank == 0:
            t0 = time.monotonic()
            try:
                a(mine(x))
                a.op.check()
                verdict = "returned"
            except Exception as err:
                verdict = (type(err).__name__, str(err).splitlines()[0], getattr(err, "__notes__", []),
                           time.monotonic() - t0, a._tag)
    comm.barrier()
    a.close()
    b.close()
    return verdict


@pytest.mark.parametrize("kind", LAYER_KINDS)
def test_a_layer_closed_on_one_rank_is_named_in_its_peers_timeout(kind):
    """Guards: layers of one shape share their op, so closing one layer on one rank leaves the op
    open for the others (``WindowPool``). A peer that then calls the closed layer waits for a rank
    that never comes and times out, as it must; its ``CommTimeoutError`` said only "stalled, died or
    lost a put" (the op's closed-op note needs the op closed). ``close()`` now leaves a note in the
    store when its op stays open, and the peer's timeout on that layer's call names the rank and
    the layer."""
    outs = check_outcomes(spawn(_peer_calls_a_layer_closed_here, world=2, args=(kind,), timeout_s=120))
    assert outs[1] == "closed"
    name, first, notes, seconds, tag = outs[0]
    assert name == "CommTimeoutError", outs[0]
    assert seconds < 2 + 2, outs[0]  # within the deadline + 2 s
    assert any(f"rank 1 closed layer #{tag} (close())" in note for note in notes), outs[0]
