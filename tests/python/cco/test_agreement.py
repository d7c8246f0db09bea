"""Construction is collective, a blank layer raises, a weight of the other layout is refused.

Guards, per test (each was seen failing before its fix; the docstrings say how):
- ranks that build the op or the layer with different arguments: before the agreement, another
  ``n`` or ``m_max`` on one rank failed the window mapping there ("mmap length is greater than file
  size") and left its peer with a closed gloo connection, and another ``quant`` built and ran with
  nothing said; now every rank raises ``ArgumentMismatchError`` naming the argument and each value;
- a ``RowParallelLinear`` called before its weight was loaded returned zeros with no word; now the
  blank rank raises naming the loaders and its peers fail the same call (fused: PeerRejectedError;
  unfused: the same RuntimeError), and the ranks stay in step;
- ``ColumnParallelLinear`` did neither: another ``mode`` or ``bias`` on one rank built with nothing
  said, and a blank rank returned zeros; now it agrees like the row layer and its blank rank fails
  a sequence-parallel call on every rank (a local, non-SP call: on its own rank);
- ``quantize_b``'s row-major weight passed to an op that reads bpreshuffle was read wrong silently.
"""

from __future__ import annotations

import pytest
import torch

from cco import quant as Q
from cco.comm import check_outcomes, spawn

pytestmark = pytest.mark.multirank

DEADLINE_S = 20.0
OP_ARGS = dict(n=256, k=256, m_max=32, quant="ptpc", mode="fused", deadline_s=DEADLINE_S)


def _build_op(comm, overrides):
    from cco.op import GemmAllReduceOp

    args = {**OP_ARGS, **overrides.get(comm.rank, {})}
    with GemmAllReduceOp(comm, **args):
        return "built"


@pytest.mark.parametrize("argument,other", [("n", 512), ("m_max", 64), ("quant", "blockscale"),
                                             ("chunks", 2), ("gather_dtype", "fp8")])
def test_op_arguments_that_differ_raise_on_every_rank(argument, other):
    outcomes = spawn(_build_op, world=2, args=({1: {argument: other}},), timeout_s=120)
    for o in outcomes:
        assert o.error_type == "ArgumentMismatchError", (o.rank, o.error_type, o.error)
        head = o.error.splitlines()[0]
        assert f"{argument} = " in head and "on rank 0" in head and "on rank 1" in head, head
        mine = {"chunks": None, "gather_dtype": "bf16", **OP_ARGS}[argument]  # the constructor's defaults
        assert f"{mine!r} on rank 0" in head and f"{other!r} on rank 1" in head, head


def test_op_arguments_rejected_alike_raise_their_own_error_on_every_rank():
    outcomes = spawn(_build_op, world=2, args=({0: {"k": 100}, 1: {"k": 100}},), timeout_s=120)
    for o in outcomes:
        assert o.error_type == "ValueError" and "K" in o.error, (o.rank, o.error_type, o.error)


def _build_layer(comm, overrides):
    from cco.nn import RowParallelLinear, WindowPool

    pool = WindowPool()
    args = dict(group=comm, quant="ptpc", m_max=8, deadline_s=DEADLINE_S, pool=pool)
    args.update(overrides.get(comm.rank, {}))
    layer = RowParallelLinear(128, 256, **args)
    layer.close()
    return "built"


@pytest.mark.parametrize("argument,other", [("m_max", 16), ("quant", "mxfp8"), ("mode", "unfused")])
def test_layer_arguments_that_differ_raise_on_every_rank(argument, other):
    outcomes = spawn(_build_layer, world=2, args=({1: {argument: other}},), timeout_s=120)
    for o in outcomes:
        assert o.error_type == "ArgumentMismatchError", (o.rank, o.error_type, o.error)
        assert f"{argument} = " in o.error.splitlines()[0], o.error


def _blank_then_loaded(comm, mode, blank_ranks):
    """Forward with ``blank_ranks`` never loaded, then load everywhere and forward again."""
    from cco.nn import RowParallelLinear, WindowPool

    n, k = 256, 128
    layer = RowParallelLinear(k, n, group=comm, quant="ptpc", m_max=8, mode=mode, deadline_s=DEADLINE_S,
                              pool=WindowPool())
    g = torch.Generator().manual_seed(comm.rank)
    w, x = torch.randn(n, k, generator=g), torch.randn(4, k, generator=g).to(torch.bfloat16)
    if comm.rank not in blank_ranks:
        layer.load_weight(w)
    first = None
    try:
        out = layer(x)
        first = ("returned", float(out.float().abs().sum()))
    except Exception as err:  # noqa: BLE001 (the test reads the type)
        first = (type(err).__name__, str(err))
    layer.load_weight(w)
    second = float(layer(x).float().abs().sum())  # in step: the next call works on every rank
    layer.close()
    return first, second


@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_a_blank_rank_fails_the_call_on_every_rank(mode):
    """Before the fix rank 1 returned zeros for its own weight's share and rank 0 a wrong sum."""
    outcomes = spawn(_blank_then_loaded, world=2, args=(mode, (1,)), timeout_s=120)
    assert all(o.ok for o in outcomes), [(o.rank, o.error_type, o.error) for o in outcomes]
    (kind0, msg0), second0 = outcomes[0].value
    (kind1, msg1), second1 = outcomes[1].value
    assert kind1 == "RuntimeError" and "load_weight" in msg1 and "load_fp8" in msg1, (kind1, msg1)
    expected_peer = "PeerRejectedError" if mode == "fused" else "RuntimeError"
    assert kind0 == expected_peer and "load_weight" in msg0, (kind0, msg0)
    assert second0 == second1 and second0 > 0


def test_a_blank_layer_alone_raises():
    outcomes = spawn(_blank_then_loaded, world=1, args=("fused", (0,)), timeout_s=120)
    (kind, msg), second = outcomes[0].value
    assert kind == "RuntimeError" and "load_fp8" in msg and second > 0


def _state_dict_counts_as_loaded(comm):
    from cco.nn import RowParallelLinear, WindowPool

    pool = WindowPool()
    src = RowParallelLinear(128, 256, group=comm, quant="ptpc", m_max=8, pool=pool)
    src.load_weight(torch.randn(256, 128))
    dst = RowParallelLinear(128, 256, group=comm, quant="ptpc", m_max=8, pool=pool)
    dst.load_state_dict(src.state_dict())
    x = torch.randn(2, 128).to(torch.bfloat16)
    same = torch.equal(dst(x), src(x))
    src.close()
    dst.close()
    return same


@pytest.mark.host
def test_a_state_dict_load_counts_as_loaded():
    outcomes = spawn(_state_dict_counts_as_loaded, world=1, timeout_s=120)
    assert outcomes[0].ok and outcomes[0].value is True, (outcomes[0].error_type, outcomes[0].error)


def _state_dict_across_layouts(comm, quant):
    """A layer whose backend reads bpreshuffle (the CPU's) and an unfused one (row-major) of the
    same weight, their state_dicts swapped; and a version-1 state_dict (the saver's layout)."""
    from cco.nn import RowParallelLinear, WindowPool
    from cco.preshuffle import preshuffle_b

    torch.manual_seed(0)
    w, x = torch.randn(256, 256), torch.randn(4, 256).to(torch.bfloat16)
    pool = WindowPool()

    def layer(mode="fused"):
        return RowParallelLinear(256, 256, group=comm, quant=quant, m_max=8, mode=mode, pool=pool)

    fused, unfused = layer(), layer("unfused")
    fused.load_weight(w)
    unfused.load_weight(w)
    found = {"layouts": (fused.weight_layout, unfused.weight_layout),
             "saved alike": torch.equal(fused.state_dict()["qweight"].view(torch.uint8),
                                        unfused.state_dict()["qweight"].view(torch.uint8))}
    into_unfused, into_fused = layer("unfused"), layer()
    into_unfused.load_state_dict(fused.state_dict())
    into_fused.load_state_dict(unfused.state_dict())
    found["fused -> unfused"] = torch.equal(into_unfused(x), unfused(x))
    found["unfused -> fused"] = torch.equal(into_fused(x), fused(x))
    old = fused.state_dict()  # as version 1 saved it: the saving layer's own layout
    old["qweight"] = preshuffle_b(old["qweight"])
    old._metadata[""]["version"] = 1
    from_v1 = layer()
    from_v1.load_state_dict(old)
    found["version 1 as it is"] = torch.equal(from_v1(x), fused(x))
    for module in (fused, unfused, into_unfused, into_fused, from_v1):
        module.close()
    return found


@pytest.mark.host
@pytest.mark.parametrize("quant", ["ptpc", "blockscale"])
def test_a_state_dict_loads_right_into_a_layer_of_the_other_weight_layout(quant):
    """Before, ``qweight`` was saved in the saving layer's layout (bpreshuffle on the CPU and gfx950,
    row-major on CUDA and unfused) and loaded as the loading layer's: a fused CPU layer's state_dict
    loaded into an unfused one gave a relative error of 1.41 with no word. Now it is saved row-major
    (state_dict version 2) and laid out on load; a version-1 state_dict loads as it did."""
    found = check_outcomes(spawn(_state_dict_across_layouts, world=1, args=(quant,), timeout_s=120))[0]
    assert found == {"layouts": ("bpreshuffle", "row-major"), "saved alike": True, "fused -> unfused": True,
                     "unfused -> fused": True, "version 1 as it is": True}, found


def _wrong_layout(comm):
    from cco.op import GemmAllReduceOp
    from cco.preshuffle import preshuffle_b

    p = Q.random_problem(32, 256, 256, "ptpc", seed=0)
    results = {}
    with GemmAllReduceOp(comm, **OP_ARGS) as op:
        try:
            op(p.a, p.b, p.a_scale, p.b_scale)  # quantize_b's row-major weight: refused
            results["row-major"] = "accepted"
        except ValueError as err:
            results["row-major"] = str(err)
        out = op(p.a, preshuffle_b(p.b), p.a_scale, p.b_scale)
        results["bpreshuffle_ok"] = bool(torch.equal(out, p.reference()))
    return results


def test_a_marked_weight_of_the_other_layout_is_refused():
    """Before the mark, the row-major weight was read as bpreshuffle: a wrong product, no error."""
    outcomes = spawn(_wrong_layout, world=1, timeout_s=120)
    assert outcomes[0].ok, (outcomes[0].error_type, outcomes[0].error)
    res = outcomes[0].value
    assert "weight_layout='bpreshuffle'" in res["row-major"] and "preshuffle_b(w)" in res["row-major"], res
    assert res["bpreshuffle_ok"], res


# --------------------------------------------------------------------------------------------------
# ColumnParallelLinear: the same agreement and blank check (the shared construction, cco.nn.parallel_linear)
def _build_column(comm, overrides):
    from cco.nn import ColumnParallelLinear, WindowPool

    args = dict(group=comm, quant="ptpc", m_max=8, sequence_parallel=True, deadline_s=DEADLINE_S, pool=WindowPool())
    args.update(overrides.get(comm.rank, {}))
    layer = ColumnParallelLinear(256, 128, **args)
    layer.close()
    return "built"


@pytest.mark.parametrize("argument,other", [("m_max", 16), ("mode", "unfused"), ("bias", True)])
def test_column_layer_arguments_that_differ_raise_on_every_rank(argument, other):
    """Before the column layer agreed, another ``mode`` or ``bias`` on one rank built and ran with
    nothing said, and another ``m_max`` raised only where its op's own agreement caught it."""
    outcomes = spawn(_build_column, world=2, args=({1: {argument: other}},), timeout_s=120)
    for o in outcomes:
        assert o.error_type == "ArgumentMismatchError", (o.rank, o.error_type, o.error)
        head = o.error.splitlines()[0]
        assert head.startswith("ColumnParallelLinear:") and f"{argument} = " in head, head


def _build_sequence_parallel(comm, cls_name, m_max):
    import cco.nn

    layer = getattr(cco.nn, cls_name)(256, 128, group=comm, m_max=m_max, sequence_parallel=True,
                                      deadline_s=DEADLINE_S, pool=cco.nn.WindowPool())
    layer.close()
    return layer.fallback_reason


@pytest.mark.parametrize("cls_name", ["RowParallelLinear", "ColumnParallelLinear"])
def test_a_sequence_parallel_layer_whose_m_max_holds_no_call_is_refused(cls_name):
    """A sequence-parallel call takes every rank's tokens, so with m_max < world no call fits the op:
    before, the layer built and ran every call unfused, saying so only in a log warning."""
    outcomes = spawn(_build_sequence_parallel, world=4, args=(cls_name, 3), timeout_s=120)
    for o in outcomes:
        assert o.error_type == "ValueError", (o.rank, o.error_type, o.error)
        assert o.error.startswith(f"{cls_name}: m_max=3 is smaller than the group's 4 ranks"), o.error
    fits = check_outcomes(spawn(_build_sequence_parallel, world=4, args=(cls_name, 4), timeout_s=120))
    assert fits == [None] * 4, fits  # m_max = world: the least that fits, and fused


def _column_blank_then_loaded(comm, mode, sequence_parallel, blank_ranks):
    """A column layer called with ``blank_ranks`` never loaded, then loaded everywhere and called
    again: (first outcome, the second call's relative L2 error against the unfused bf16 product)."""
    from cco.nn import ColumnParallelLinear, WindowPool

    k, n_r, rows = 256, 128, 4
    layer = ColumnParallelLinear(k, n_r, group=comm, quant="ptpc", m_max=16, mode=mode,
                                 sequence_parallel=sequence_parallel, deadline_s=DEADLINE_S, pool=WindowPool())
    xs = [torch.randn(rows, k, generator=torch.Generator().manual_seed(100 + r)).to(torch.bfloat16)
          for r in range(comm.world)]  # every rank's tokens: rank r passes xs[r] with sequence_parallel
    w = torch.randn(n_r, k, generator=torch.Generator().manual_seed(comm.rank))
    x = xs[comm.rank] if sequence_parallel else xs[0]
    if comm.rank not in blank_ranks:
        layer.load_weight(w)
    try:
        out = layer(x)
        first = ("returned", float(out.float().abs().sum()))
    except Exception as err:  # noqa: BLE001 (the test reads the type)
        first = (type(err).__name__, str(err))
    layer.load_weight(w)
    with torch.no_grad():
        second = layer(x).float()
    full = torch.cat(xs) if sequence_parallel else x
    ref = full.float() @ w.to(torch.bfloat16).float().t()
    layer.close()
    return first, float((second - ref).norm() / ref.norm())


@pytest.mark.parametrize("mode", ["fused", "unfused"])
def test_a_blank_rank_fails_the_sequence_parallel_column_call_on_every_rank(mode):
    """Before the column layer checked, rank 1 returned zeros for its columns with no word (and its
    peer's call succeeded)."""
    outcomes = spawn(_column_blank_then_loaded, world=2, args=(mode, True, (1,)), timeout_s=120)
    assert all(o.ok for o in outcomes), [(o.rank, o.error_type, o.error) for o in outcomes]
    (kind0, msg0), err0 = outcomes[0].value
    (kind1, msg1), err1 = outcomes[1].value
    assert kind1 == "RuntimeError" and "load_weight" in msg1 and "load_fp8" in msg1, (kind1, msg1)
    assert kind1 == "RuntimeError" and "ColumnParallelLinear" in msg1, msg1
    expected_peer = "PeerRejectedError" if mode == "fused" else "RuntimeError"
    assert kind0 == expected_peer and "load_weight" in msg0, (kind0, msg0)
    assert err0 < 0.05 and err1 < 0.05, (err0, err1)  # in step: the next call is right on every rank


def test_a_blank_local_column_layer_raises_on_its_own_rank():
    """Without sequence parallelism the column layer's GEMM is local: the blank rank raises, its
    peer (no collective to fail) returns its product."""
    outcomes = spawn(_column_blank_then_loaded, world=2, args=("fused", False, (1,)), timeout_s=120)
    assert all(o.ok for o in outcomes), [(o.rank, o.error_type, o.error) for o in outcomes]
    (kind0, _), err0 = outcomes[0].value
    (kind1, msg1), err1 = outcomes[1].value
    assert kind0 == "returned" and kind1 == "RuntimeError" and "load_fp8" in msg1, (kind0, kind1, msg1)
    assert err0 < 0.05 and err1 < 0.05, (err0, err1)


# --------------------------------------------------------------------------------------------------
# options no backend takes: the caller's error on every rank, never a reason to run unfused
BAD_OPTIONS = (("transport", "nvlink", "transport='nvlink' is not supported"),
               ("gather_dtype", "fp16", "gather_dtype='fp16' is not supported"),
               ("chunks", 0, "chunks=0 is not supported"),
               ("chunks", (1, 0), "chunks=(1, 0) is not supported"),
               ("deadline_s", -1, "deadline_s=-1 must be > 0 seconds"))


def _build_with_bad_options(comm):
    """Every (layer, mode, bad option) built on this rank: {case: (error type, first line)}."""
    found = {}
    for layer in ("row", "row-sp", "column-sp"):
        for mode in ("fused", "unfused"):
            for option, value, _ in BAD_OPTIONS:
                if layer == "column-sp" and option == "gather_dtype":
                    continue  # the column layer takes no gather_dtype (its all-gather moves fp8 input rows)
                case = (layer, mode, option, repr(value))
                build = _build_column if layer == "column-sp" else _build_layer
                extra = {"sequence_parallel": True} if layer == "row-sp" else {}
                try:
                    build(comm, {comm.rank: {option: value, "mode": mode, **extra}})
                    found[case] = ("built", "")
                except Exception as err:
                    found[case] = (type(err).__name__, str(err).splitlines()[0])
    return found


def test_layer_options_no_backend_takes_raise_on_every_rank():
    """Before, a misspelt transport, gather_dtype='fp16' or chunks=0 built a layer that logged
    "runs unfused" (the backend's refusal of the shape taken for a fallback reason) and ran the slow
    path; deadline_s=-1 raised naming GemmAllReduceOp, and not at all with mode='unfused'. Now each
    is a ValueError naming the layer, on every rank, in every mode, for both layers."""
    outcomes = spawn(_build_with_bad_options, world=2, timeout_s=300)
    says = {option + repr(value): text for option, value, text in BAD_OPTIONS}
    for o in outcomes:
        assert o.error is None, (o.rank, o.error_type, o.error)
        assert len(o.value) == 3 * 2 * len(BAD_OPTIONS) - 2
        for (layer, mode, option, value), (kind, head) in o.value.items():
            name = "ColumnParallelLinear" if layer == "column-sp" else "RowParallelLinear"
            assert kind == "ValueError" and head.startswith(f"{name}:") and says[option + value] in head, \
                (o.rank, layer, mode, option, value, kind, head)


# settings a layer took and dropped: backward="fp8" without sequence parallelism (no collective to
# fuse), gather_dtype with it (the reduce-scatter gathers nothing); refused now, on every rank
IGNORED_BEFORE = (("row", {"backward": "fp8"}, "backward='fp8' fuses a sequence-parallel"),
                  ("column", {"backward": "fp8", "sequence_parallel": False},
                   "backward='fp8' fuses a sequence-parallel"),
                  ("row", {"gather_dtype": "fp8", "sequence_parallel": True}, "gather_dtype='fp8' sets the all-reduce"))


def _build_with_ignored_settings(comm):
    found = []
    for layer, overrides, _ in IGNORED_BEFORE:
        build = _build_column if layer == "column" else _build_layer
        try:
            build(comm, {comm.rank: overrides})
            found.append(("built", ""))
        except Exception as err:
            found.append((type(err).__name__, str(err).splitlines()[0]))
    return found


def test_settings_a_layer_would_ignore_raise_on_every_rank():
    """Before, ``RowParallelLinear(backward="fp8")`` and ``ColumnParallelLinear(backward="fp8")``
    without sequence parallelism, and ``RowParallelLinear(sequence_parallel=True,
    gather_dtype="fp8")``, built and dropped the setting with nothing said (each case "built"
    there); ``cco.integrations``' ``FusedOptions`` hands each layer only what applies to it."""
    outcomes = spawn(_build_with_ignored_settings, world=2, timeout_s=120)
    for o in outcomes:
        assert o.error is None, (o.rank, o.error_type, o.error)
        for (layer, _, text), (kind, head) in zip(IGNORED_BEFORE, o.value):
            name = "ColumnParallelLinear" if layer == "column" else "RowParallelLinear"
            assert kind == "ValueError" and head.startswith(f"{name}:") and text in head, (o.rank, layer, kind, head)


def test_fused_options_hand_each_row_layer_what_applies_to_it():
    from cco.integrations.fused import FusedOptions

    opts = FusedOptions(gather_dtype="fp8", backward="fp8")
    sp, plain = opts.row_kwargs(sequence_parallel=True), opts.row_kwargs(sequence_parallel=False)
    assert "gather_dtype" not in sp and sp["backward"] == "fp8"
    assert "backward" not in plain and plain["gather_dtype"] == "fp8"
    assert "gather_dtype" not in opts.column_kwargs() and opts.column_kwargs()["backward"] == "fp8"


# --------------------------------------------------------------------------------------------------
# the window pool: whether a family's op is open must be the same on every rank
def _closed_on_one_rank(comm):
    from cco.nn import RowParallelLinear, WindowPool

    pool = WindowPool()
    args = dict(group=comm, quant="ptpc", m_max=8, deadline_s=DEADLINE_S, pool=pool)
    a = RowParallelLinear(128, 256, **args)
    if comm.rank == 1:
        a.close()  # local: releases rank 1's op, the family's last user there
    try:
        RowParallelLinear(128, 256, **args)
        return "built"
    except Exception as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0]}"


def test_a_layer_closed_on_one_rank_fails_the_next_build_of_its_family_on_every_rank():
    """Before, rank 1 (whose pool held no op of the family any more) built a new op, a collective
    construction, while rank 0 reused its pooled one: rank 1 waited in the build until rank 0's
    process ended (the spawn's timeout here) and rank 0's later calls timed out. Now the ranks
    agree on whether the pool holds the op first, and both raise naming the mismatch."""
    outcomes = spawn(_closed_on_one_rank, world=2, timeout_s=120)
    for o in outcomes:
        assert o.error is None, (o.rank, o.error_type, o.error)
        assert o.value.startswith("ArgumentMismatchError: RowParallelLinear:") and "an open op of this family" in \
            o.value and "True on rank 0" in o.value and "False on rank 1" in o.value, (o.rank, o.value)


# --------------------------------------------------------------------------------------------------
# a trainable layer's stored fp8 weight follows its master weight
def _master_follows(comm):
    from cco.nn import RowParallelLinear, WindowPool

    torch.manual_seed(0)
    w, x = torch.randn(256, 256), torch.randn(4, 256)
    pool = WindowPool()

    def fresh(weight, trainable=False):
        layer = RowParallelLinear(256, 256, group=comm, m_max=8, trainable=trainable, pool=pool)
        layer.load_weight(weight.float())
        return layer.eval()

    found = {}
    layer = RowParallelLinear(256, 256, group=comm, m_max=8, trainable=True, pool=pool)
    layer.load_weight(w)
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    layer(x).float().square().sum().backward()  # train mode
    opt.step()
    saved = layer.state_dict()  # mid-training, still in train mode
    into_eval = RowParallelLinear(256, 256, group=comm, m_max=8, trainable=True, pool=pool).eval()
    into_eval.load_state_dict(saved)
    with torch.no_grad():
        found["state_dict saved in train mode, loaded in eval"] = torch.equal(into_eval(x), fresh(layer.weight)(x))
    layer.eval()
    opt.zero_grad()
    layer(x).float().square().sum().backward()  # a step taken in eval mode
    opt.step()
    with torch.no_grad():
        found["a step taken in eval mode"] = torch.equal(layer(x), fresh(layer.weight)(x))
    return found


def test_a_trainable_layers_fp8_weight_follows_its_master_weight():
    """Before, the stored fp8 weight was refreshed from the master only by load_weight and eval():
    a state_dict saved in train mode carried the fp8 weight of before training (an eval-mode layer
    loading it served the old weights, no error), and an optimizer step taken in eval mode was
    ignored by the next eval forward. Now the stored weight follows the master's version, and a
    state_dict saves the master's quantization."""
    found = check_outcomes(spawn(_master_follows, world=1, timeout_s=120))[0]
    assert all(found.values()), found
