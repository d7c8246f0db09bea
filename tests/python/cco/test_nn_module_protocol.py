"""The layers under nn.Module's own calls: dtype and device conversions, ``load_state_dict(assign=True)``,
a state_dict of another dtype, copies.

Guards, per test (each was seen failing before its fix; the docstrings say how):
- ``model.to(torch.bfloat16)`` (``.half()``, ``.float()``, ``.double()``) cast the layer's e4m3
  weight and its fp32 scales like any floating tensor: the quantized weight was lost (a bf16
  tensor in place of an fp8 one, which the next call's op refused: "b_pre must be
  torch.float8_e4m3fn, got torch.bfloat16"); now the layer's own tensors keep their dtypes while the rest of the model
  converts, and the output is bit for bit the same;
- a move to another device moved the buffers away from the group's window and kernels; now it raises;
- ``load_state_dict(assign=True)`` put the state_dict's tensors in place of the layer's (an fp32
  bias in a layer that adds a bf16 one, and a weight the blank check took for unwritten); now it copies;
- a state_dict without its metadata (a plain dict; safetensors keeps none) was read as the
  layout of version 1, the saver's: a row-major weight read as bpreshuffle by the CPU (and gfx950)
  layers, wrong outputs with nothing said; now it is read as the current version (row-major);
- a state_dict whose ``qweight`` was not e4m3 (a bf16 weight saved by mistake) was cast into
  the fp8 buffer with nothing said; now the load raises naming both dtypes;
- a 1-D input ``[in_features]`` (what ``nn.Linear`` takes) raised in the local column layer
  ("shape '[256, 128]' is invalid for input of size 128": its output took the input's first
  dimension for the tokens); now both layers return ``[out_features]``, as nn.Linear does;
- a trainable layer in eval mode kept serving its old fp8 weight after ``weight.data = new`` (the
  master's version does not move); now its storage is watched too. ``weight.data.copy_(new)`` moves
  neither (``.data`` bypasses the version counter): the guide says to call ``eval()`` after it,
  and the test checks that this works;
- a model's layers held their windows after the model was deleted (the pool holds a family's op
  until its last layer is closed), and nothing closed a model's layers at once: a process loading
  models in turn grew by every family's window; ``cco.nn.close_layers(model)`` closes them;
- ``copy.deepcopy(layer)`` and pickling failed on the process group deep inside, and ``copy.copy``
  made a second layer on the same op (its ``close`` released the op its original still used);
  now each raises a TypeError that says why and what to do instead.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from cco.comm import check_outcomes, spawn

pytestmark = [pytest.mark.multirank, pytest.mark.host]

QUANTS = ("ptpc", "blockscale", "mxfp8")
CONVERSIONS = {
    "to(bfloat16)": lambda m: m.to(torch.bfloat16),
    "half()": lambda m: m.half(),
    "float()": lambda m: m.float(),
    "double()": lambda m: m.double(),
    "to(cpu, float16)": lambda m: m.to("cpu", torch.float16),
    "cpu()": lambda m: m.cpu(),
}


def _layers(comm, quant, pool):
    from cco.nn import ColumnParallelLinear, RowParallelLinear

    row = RowParallelLinear(256, 128, group=comm, quant=quant, m_max=8, bias=True, trainable=True, pool=pool)
    col = ColumnParallelLinear(256, 128, group=comm, quant=quant, m_max=8, bias=True, pool=pool)
    return row, col


def _own_dtypes(row, col):
    return [tuple(t.dtype for t in (layer.qweight, layer.weight_scale, layer.bias)) for layer in (row, col)] + [
        row.weight.dtype]


def _conversions(comm, quant):
    from cco.nn import WindowPool

    pool = WindowPool()
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(128, 256, generator=g), torch.randn(128, generator=g).to(torch.bfloat16)
    x = torch.randn(4, 256, generator=g).to(torch.bfloat16)
    found = {}
    for name, convert in CONVERSIONS.items():
        row, col = _layers(comm, quant, pool)
        tail = torch.nn.Linear(128, 8)  # the rest of the model: converts as asked
        for layer in (row, col):
            layer.load_weight(w)
            with torch.no_grad():
                layer.bias.copy_(bias)
        row.eval()
        before = [row(x), col(x)]
        dtypes = _own_dtypes(row, col)
        model = torch.nn.Sequential(row, col, tail)
        convert(model)
        after = [row(x), col(x)]
        found[name] = {
            "same output": all(torch.equal(a, b) for a, b in zip(before, after)),
            "own dtypes kept": _own_dtypes(row, col) == dtypes,
            "the rest converts": tail.weight.dtype == (convert(torch.nn.Linear(1, 1)).weight.dtype),
        }
        row.close()
        col.close()
    return found


@pytest.mark.parametrize("quant", QUANTS)
def test_a_dtype_conversion_of_the_model_leaves_the_layers_weight_as_it_is(quant):
    """Before: ``to(bfloat16)``, ``half()``, ``float()``, ``double()`` cast ``qweight`` out of e4m3
    and the scales with it, and the next call raised in the op ("b_pre must be torch.float8_e4m3fn")."""
    found = check_outcomes(spawn(_conversions, world=1, args=(quant,), timeout_s=180))[0]
    want = {"same output": True, "own dtypes kept": True, "the rest converts": True}
    assert found == {name: want for name in CONVERSIONS}, found


def _moves(comm):
    from cco.nn import WindowPool

    pool = WindowPool()
    row, col = _layers(comm, "ptpc", pool)
    found = {}
    for layer in (row, col):
        layer.load_weight(torch.randn(128, 256))
        kept = [layer.qweight, layer.weight_scale, layer.bias]
        try:
            layer.to("meta")  # another device than the layer's (the CPU machine's only other one)
            found[type(layer).__name__] = "moved"
        except ValueError as err:
            found[type(layer).__name__] = ("cannot move to meta" in str(err) and "build it on meta" in str(err),
                                           all(a is b for a, b in zip(kept, [layer.qweight, layer.weight_scale,
                                                                              layer.bias])),
                                           layer.qweight.device.type)
    row.close()
    col.close()
    return found


def test_a_move_to_another_device_raises_and_moves_nothing():
    found = check_outcomes(spawn(_moves, world=1, timeout_s=120))[0]
    assert found == {"RowParallelLinear": (True, True, "cpu"), "ColumnParallelLinear": (True, True, "cpu")}, found


def _state_dicts(comm, quant):
    from cco.nn import RowParallelLinear, WindowPool

    pool = WindowPool()

    def layer():
        return RowParallelLinear(256, 128, group=comm, quant=quant, m_max=8, bias=True, pool=pool)

    src = layer()
    src.load_weight(torch.randn(128, 256))
    with torch.no_grad():
        src.bias.normal_()
    x = torch.randn(4, 256).to(torch.bfloat16)
    saved = src.state_dict()
    found = {}
    dst = layer()
    own = [dst.qweight, dst.weight_scale, dst.bias]
    fp32_bias = {k: (v.float() if k == "bias" else v.clone()) for k, v in saved.items()}
    try:
        dst.load_state_dict(fp32_bias, assign=True)
        found["assign"] = (torch.equal(dst(x), src(x)), dst.bias.dtype,
                           all(a is b for a, b in zip(own, [dst.qweight, dst.weight_scale, dst.bias])))
    except RuntimeError as err:
        found["assign"] = str(err)[:200]
    plain = layer()  # a state_dict without its metadata: a plain dict, or one read back from safetensors
    plain.load_state_dict({k: v.clone() for k, v in saved.items()})
    found["plain dict"] = torch.equal(plain(x), src(x))
    bad = dict(saved)
    bad["qweight"] = saved["qweight"].to(torch.bfloat16)
    other = layer()
    try:
        other.load_state_dict(bad)
        found["bf16 qweight"] = "loaded"
    except RuntimeError as err:
        msg = str(err)
        found["bf16 qweight"] = ("qweight is torch.bfloat16 in the state_dict" in msg
                                 and "torch.float8_e4m3fn" in msg and "Missing key" not in msg)
    for module in (src, dst, plain, other):
        module.close()
    return found


@pytest.mark.parametrize("quant", ["ptpc", "mxfp8"])
def test_a_state_dict_is_copied_into_the_layers_own_tensors(quant):
    """Before: ``assign=True`` took the state_dict's tensors (an fp32 bias kept as fp32, and the
    call raised "called before its weight was loaded"); a state_dict without its metadata (a plain
    dict, safetensors) was read as version 1, its row-major ``qweight`` taken for the CPU layer's
    bpreshuffle order (wrong outputs, nothing said); a bf16 ``qweight`` was cast into e4m3."""
    found = check_outcomes(spawn(_state_dicts, world=1, args=(quant,), timeout_s=120))[0]
    assert found == {"assign": (True, torch.bfloat16, True), "plain dict": True, "bf16 qweight": True}, found


def _copies(comm):
    from cco.nn import WindowPool

    pool = WindowPool()
    found = {}
    for layer in _layers(comm, "ptpc", pool):
        for verb, copy_ in (("copied", copy.deepcopy), ("copied", copy.copy), ("pickled", pickle.dumps)):
            try:
                copy_(layer)
                found[(type(layer).__name__, copy_.__name__)] = "copied"
            except TypeError as err:
                found[(type(layer).__name__, copy_.__name__)] = (
                    f"cannot be {'copied' if copy_ is copy.deepcopy else 'pickled'}" in str(err)
                    and "load_state_dict(layer.state_dict())" in str(err))
        layer.close()
    return found


def test_a_copy_of_a_layer_is_refused_with_the_way_to_build_one():
    """Before: ``TypeError: cannot pickle 'torch._C._distributed_c10d.ProcessGroup' object`` (deepcopy,
    pickle); ``copy.copy`` returned a layer sharing the original's op and handle."""
    found = check_outcomes(spawn(_copies, world=1, timeout_s=120))[0]
    assert set(found.values()) == {True}, found


def _one_dimensional(comm):
    from cco.nn import WindowPool

    found = {}
    for layer in _layers(comm, "ptpc", WindowPool()):
        layer.load_weight(torch.randn(128, 256))
        x = torch.randn(256).to(torch.bfloat16)
        for how, call in (("eager", lambda: layer(x)), ("with a gradient", lambda: layer(x.requires_grad_())),
                          ("compiled", lambda: torch.compile(layer, fullgraph=True, backend="eager")(x))):
            try:
                y = call()
                found[(type(layer).__name__, how)] = (tuple(y.shape), torch.equal(y, layer(x[None])[0]))
            except RuntimeError as err:
                found[(type(layer).__name__, how)] = str(err)[:120]
            x = x.detach()
        layer.close()
    return found


def test_a_one_dimensional_input_gives_a_one_dimensional_output():
    """Before: the column layer raised "shape '[256, 128]' is invalid for input of size 128"."""
    found = check_outcomes(spawn(_one_dimensional, world=1, timeout_s=120))[0]
    assert set(found.values()) == {((128,), True)}, found


def _master_data_writes(comm):
    from cco.nn import WindowPool

    row, col = _layers(comm, "ptpc", WindowPool())
    x = torch.randn(4, 256).to(torch.bfloat16)
    row.load_weight(torch.randn(128, 256))
    row.eval()
    found = {}
    with torch.no_grad():
        new = torch.randn(128, 256).to(torch.bfloat16)
        row.weight.data = new.clone()
        found["weight.data = new"] = torch.equal(row(x), row.train()(x))
        row.eval()
        row.weight.data.copy_(-new)
        row.eval()  # the guide's step after a write through .data
        found["weight.data.copy_ then eval()"] = torch.equal(row(x), row.train()(x))
    row.close()
    col.close()
    return found


def test_a_master_replaced_through_data_is_followed_in_eval_mode():
    """Before: after ``weight.data = new`` the eval-mode call kept the old fp8 weight (relative error
    1.4 against the new one) while a train-mode call used the new one."""
    found = check_outcomes(spawn(_master_data_writes, world=1, timeout_s=120))[0]
    assert found == {"weight.data = new": True, "weight.data.copy_ then eval()": True}, found


def _close_layers(comm):
    from cco.nn import WindowPool, close_layers

    pool = WindowPool()
    row, col = _layers(comm, "ptpc", pool)
    model = torch.nn.Sequential(row, torch.nn.ReLU(), col)
    ops = [row.op, col.op]
    found = {"users before": [pool.users(op) for op in ops], "closed": close_layers(model),
             "users after": [pool.users(op) for op in ops], "ops closed": [op._closed for op in ops],
             "again": close_layers(model)}
    again, _ = _layers(comm, "ptpc", pool)  # the family builds anew on every rank
    again.load_weight(torch.randn(128, 256))
    found["a new layer runs"] = tuple(again(torch.randn(2, 256).to(torch.bfloat16)).shape)
    again.close()
    pool.close()
    return found


def test_close_layers_frees_every_window_of_a_model():
    outs = check_outcomes(spawn(_close_layers, world=2, timeout_s=120))
    for found in outs:
        assert found == {"users before": [1, 1], "closed": 2, "users after": [0, 0], "ops closed": [True, True],
                         "again": 0, "a new layer runs": (2, 128)}, found
