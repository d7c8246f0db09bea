"""Every bad input to a GEMM entry point raises an error that names the argument and the fix."""

import pytest
import torch

from cco.preshuffle import preshuffle_b
from cco.quant import QUANTS, random_problem
from cco.validate import check_operands

FN = "gemm"


def _ops(quant, m=32, n=256, k=256):
    p = random_problem(m, n, k, quant, seed=1)
    return p.a, preshuffle_b(p.b), p.a_scale, p.b_scale


@pytest.mark.parametrize("quant", QUANTS)
def test_good_operands_pass(quant):
    shape = check_operands(*_ops(quant), quant=quant, fn=FN)
    assert (shape.m, shape.n, shape.k) == (32, 256, 256)


def test_fnuz_rejected_with_reason():
    a, b, sa, sb = _ops("ptpc")
    with pytest.raises(TypeError, match=r"gemm: a is float8_e4m3fnuz.*not OCP e4m3.*float8_e4m3fn"):
        check_operands(a.float().to(torch.float8_e4m3fnuz), b, sa, sb, quant="ptpc", fn=FN)


def test_wrong_dtype_named():
    a, b, sa, sb = _ops("ptpc")
    with pytest.raises(TypeError, match="b_pre must be torch.float8_e4m3fn, got torch.bfloat16"):
        check_operands(a, b.to(torch.bfloat16), sa, sb, quant="ptpc", fn=FN)


@pytest.mark.parametrize("k", [128, 384 + 64])
def test_k_rules(k):
    a = torch.zeros(32, k).to(torch.float8_e4m3fn)
    b = torch.zeros(256, k).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=rf"K={k} is not supported; K must be >= 256 and a multiple of 128"):
        check_operands(a, b, torch.ones(32), torch.ones(256), quant="ptpc", fn=FN)


def test_k_mismatch():
    a, _, sa, _ = _ops("ptpc")
    b = torch.zeros(256, 512).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="K dimensions must match"):
        check_operands(a, b, sa, torch.ones(256), quant="ptpc", fn=FN)


def test_row_major_blockscale_a_scale_rejected_with_fix():
    a, b, sa, sb = _ops("blockscale", k=512)
    with pytest.raises(ValueError, match=r"column-major.*a_scale.t\(\).contiguous\(\).t\(\)"):
        check_operands(a, b, sa.contiguous(), sb, quant="blockscale", fn=FN)


def test_scale_shape_and_dtype():
    a, b, sa, sb = _ops("ptpc")
    with pytest.raises(ValueError, match=r"b_scale for quant='ptpc' must have shape \[256\]"):
        check_operands(a, b, sa, sb[:128], quant="ptpc", fn=FN)
    a, b, sa, sb = _ops("mxfp8")
    with pytest.raises(TypeError, match="a_scale for quant='mxfp8' must be float8_e8m0fnu"):
        check_operands(a, b, sa.float(), sb, quant="mxfp8", fn=FN)


def test_n_multiple():
    a, b, sa, sb = _ops("ptpc")
    with pytest.raises(ValueError, match="N=256 must be a multiple of 512"):
        check_operands(a, b, sa, sb, quant="ptpc", fn=FN, n_multiple=512)


def test_non_contiguous_rejected():
    a, b, sa, sb = _ops("ptpc", k=512)
    with pytest.raises(ValueError, match=r"a must be contiguous.*a.contiguous\(\)"):
        check_operands(a[:, ::2], b[:, :256], sa, sb, quant="ptpc", fn=FN)


def test_unknown_quant():
    with pytest.raises(ValueError, match="quant='int8' is not supported"):
        check_operands(*_ops("ptpc"), quant="int8", fn=FN)
