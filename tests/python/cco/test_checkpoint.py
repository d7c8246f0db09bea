"""fp8 checkpoints as they ship (``cco.nn.checkpoint``) and ``RowParallelLinear.load_checkpoint``.

Each format's checkpoint is written with safetensors from a float weight, read back, and its weight
compared with the format's own definition (``q * scale`` over the scale's blocks, written out here
apart from the module): exactly. Guards: a scale read as the wrong layout or dtype (ue8m0, e8m0 and
uint8 codes, bf16 per-row scales, a per-tensor scalar), a ragged last block (N=200, K=320 with 128
blocks) dropped or misplaced, a shard that does not start on a scale block or takes the wrong
scale columns (each shard's weight must equal the slice of the whole), a lossy conversion done
silently, a format served that cannot be (fnuz, e5m2, packed 4-bit, other block sizes), and the
layer's product against ``x @ W.T``.
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from cco import quant as Q
from cco.comm import check_outcomes, spawn
from cco.nn import checkpoint as C

N, K = 200, 320  # ragged in both: 2 x 3 blocks of 128, the last ones 72 rows and 64 columns
K_SHARDED = 448  # 3.5 blocks: world 2 shards 256 + 192, world 4 128 x 3 + 64 (the last block ragged)
# The layer's product against x @ W.T: the activations' e4m3 rounding (half an ulp is 2**-4
# relative; ~2-3% rms of a dot product), plus one bf16 rounding.
FP8_ACTIVATION_BUDGET = 0.05


def _cdiv(a, b):
    return -(-a // b)


def float_weight(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    # magnitudes that differ by row and by K block, so a scale from the wrong block shows
    return (torch.randn(n, k, generator=g) * torch.exp2(torch.randint(-3, 4, (n, 1), generator=g).float())
            * torch.exp2(torch.randint(-3, 4, (1, _cdiv(k, 32)), generator=g).float()).repeat_interleave(32, 1)[:, :k])


def _blocks(w, bn, bk):
    n, k = w.shape
    p = torch.nn.functional.pad(w, (0, _cdiv(k, bk) * bk - k, 0, _cdiv(n, bn) * bn - n))
    return p.view(_cdiv(n, bn), bn, _cdiv(k, bk), bk)


def _expand(scale, n, k, bn, bk):
    return scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]


def _e4m3(w, scale_full):
    return (w / scale_full).clamp(-Q.FP8_MAX, Q.FP8_MAX).to(Q.FP8)


def ct_config(**weights):
    """A compressed-tensors quantization_config with one scheme for every Linear."""
    scheme = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", **weights}}
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": scheme}}


def write(fmt: str, n: int, k: int, seed: int = 0, prefix: str = "model.layers.0.mlp.down_proj"):
    """(tensors, config, expected fp32 weight) of one linear in format ``fmt``, quantized here from a
    float weight; the expected weight is the format's definition of the stored bytes."""
    w = float_weight(n, k, seed)
    amax_block = _blocks(w, 128, 128).abs().amax(dim=(1, 3)).clamp_min(1e-12)  # [ceil(N/128), ceil(K/128)]
    t, config = {}, None
    if fmt in ("deepseek-v3", "deepseek-v3:ue8m0", "deepseek-v4", "compressed-tensors:FP8_BLOCK"):
        s = amax_block / Q.FP8_MAX
        if fmt != "deepseek-v3" and fmt != "compressed-tensors:FP8_BLOCK":
            s = torch.exp2(torch.ceil(torch.log2(s)))  # power-of-two scales (ue8m0)
        q = _e4m3(w, _expand(s, n, k, 128, 128))
        full = q.float() * _expand(s, n, k, 128, 128)
        if fmt == "deepseek-v4":
            t[f"{prefix}.scale"] = s.to(Q.E8M0)
            config = {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
        elif fmt == "compressed-tensors:FP8_BLOCK":
            t[f"{prefix}.weight_scale"] = s
            config = ct_config(strategy="block", block_structure=[128, 128])
        else:
            t[f"{prefix}.weight_scale_inv"] = s
            config = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
            if fmt.endswith("ue8m0"):
                config["scale_fmt"] = "ue8m0"
    elif fmt == "compressed-tensors:FP8_DYNAMIC":
        s = (w.abs().amax(dim=1, keepdim=True) / Q.FP8_MAX).to(torch.bfloat16)  # [N, 1], the model's dtype
        q = _e4m3(w, s.float())
        full = q.float() * s.float()
        t[f"{prefix}.weight_scale"] = s
        config = ct_config(strategy="channel")
    elif fmt == "compressed-tensors:FP8":
        s = (w.abs().amax() / Q.FP8_MAX).reshape(())
        q = _e4m3(w, s)
        full = q.float() * s
        t[f"{prefix}.weight_scale"] = s
        t[f"{prefix}.input_scale"] = torch.tensor(0.02)  # static activation scale: not read
    elif fmt == "compressed-tensors:MXFP8":
        amax = _blocks(w, 1, 32).abs().amax(dim=(1, 3)).clamp_min(1e-12)  # [N, ceil(K/32)]
        e = torch.ceil(torch.log2(amax / Q.FP8_MAX))
        q = _e4m3(w, _expand(torch.exp2(e), n, k, 1, 32))
        full = q.float() * _expand(torch.exp2(e), n, k, 1, 32)
        t[f"{prefix}.weight_scale"] = (e + 127).to(torch.uint8)
        config = ct_config(strategy="group", group_size=32)
    else:
        raise AssertionError(fmt)
    t[f"{prefix}.weight"] = q
    return t, config, full


FORMATS = {"deepseek-v3": "blockscale", "deepseek-v3:ue8m0": "blockscale", "deepseek-v4": "blockscale",
           "compressed-tensors:FP8_DYNAMIC": "ptpc", "compressed-tensors:FP8": "ptpc",
           "compressed-tensors:FP8_BLOCK": "blockscale", "compressed-tensors:MXFP8": "mxfp8"}
NAME = "model.layers.0.mlp.down_proj.weight"


def saved(tmp_path, fmt, n, k, seed=0):
    t, config, full = write(fmt, n, k, seed)
    path = str(tmp_path / f"{fmt.replace(':', '_')}.safetensors")
    save_file(t, path)
    return path, config, full


# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_config", [True, False], ids=["config", "tensors-only"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_reads_as_its_quant_with_the_stored_weight(tmp_path, fmt, with_config):
    """N=200, K=320 (ragged last blocks): read back from the file (whole and through safe_open), the
    weight is the checkpoint's exactly, in the quant and scale layout cco serves it as."""
    path, config, full = saved(tmp_path, fmt, N, K)
    config = config if with_config else None
    w = C.read_fp8_weight(load_file(path), NAME, config=config)
    assert (w.quant, w.source) == (FORMATS[fmt], fmt)
    assert w.shape == (N, K) and (w.scale.shape, w.scale.dtype) == C.scale_shape(N, K, w.quant)
    assert torch.equal(C.dequantize(w), full)
    with safe_open(path, framework="pt") as handle:
        lazy = C.read_fp8_weight(handle, NAME, config=config)
    assert torch.equal(lazy.scale.float(), w.scale.float()) and torch.equal(C.dequantize(lazy), full)


@pytest.mark.parametrize("fmt", ["deepseek-v3", "deepseek-v4", "compressed-tensors:FP8_BLOCK",
                                 "compressed-tensors:MXFP8"])
def test_a_weight_of_one_block_keeps_its_format(fmt):
    """N=1, K=32: one 128x128 block and one 32-group, so the scale is [1, 1] like a per-tensor scale;
    an e8m0 or uint8 one is still read as block or group scales, a float one serves as either."""
    t, config, full = write(fmt, 1, 32)
    w = C.read_fp8_weight(t, NAME, config=config)
    assert torch.equal(C.dequantize(w), full)
    assert w.quant == {"compressed-tensors:MXFP8": "mxfp8", "deepseek-v4": "blockscale"}.get(fmt, w.quant)
    for quant in ("ptpc", "blockscale"):
        assert torch.equal(C.dequantize(C.convert_fp8_weight(w, quant)), full)


@pytest.mark.parametrize("dim, world", [(1, 2), (1, 4), (0, 2)], ids=["K-world2", "K-world4", "N-world2"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_shards_are_whole_blocks_and_equal_the_slice_of_the_whole(tmp_path, fmt, dim, world):
    """K=448 (3.5 blocks) or N=200 (1.6 blocks): every shard starts on a scale block, all are
    shard_width wide but the last, which ends in the ragged block; each shard's weight equals the
    slice of the whole weight exactly and the shards cover it."""
    path, config, full = saved(tmp_path, fmt, N, K_SHARDED)
    w = C.read_fp8_weight(load_file(path), NAME, config=config)
    width = C.shard_width(w, world=world, dim=dim)
    block = C.block_of(w.quant, dim)
    assert width % block == 0 and width * (world - 1) < w.shape[dim] <= width * world
    parts = []
    for rank in range(world):
        s = C.shard_fp8_weight(w, rank=rank, world=world, dim=dim)
        stop = min((rank + 1) * width, w.shape[dim])
        assert s.shape[dim] == stop - rank * width and s.shape[1 - dim] == w.shape[1 - dim]
        part = C.dequantize(s)
        expect = full[:, rank * width:stop] if dim == 1 else full[rank * width:stop]
        assert torch.equal(part, expect), f"rank {rank}"
        parts.append(part)
    assert torch.equal(torch.cat(parts, dim=dim), full)


def test_exact_conversions_are_made_and_lossy_ones_refused(tmp_path):
    """Power-of-two block scales serve an mxfp8 layer and a per-tensor scale a blockscale one, with
    the same weight; fp32 (non power-of-two) block scales have no mxfp8 form and per-row scales no
    block form: an error, not a requantization."""
    for fmt, quant in (("deepseek-v3:ue8m0", "mxfp8"), ("deepseek-v4", "mxfp8"),
                       ("compressed-tensors:FP8", "blockscale"), ("compressed-tensors:FP8", "mxfp8"),
                       ("deepseek-v3", "ptpc")):
        t, config, full = write(fmt, N, K)
        w = C.read_fp8_weight(t, NAME, config=config)
        if (fmt, quant) in (("compressed-tensors:FP8", "mxfp8"), ("deepseek-v3", "ptpc")):
            with pytest.raises(ValueError, match=f"no exact {quant} form"):
                C.convert_fp8_weight(w, quant)
            continue
        v = C.convert_fp8_weight(w, quant)
        assert v.quant == quant and v.qweight is w.qweight and torch.equal(C.dequantize(v), full), (fmt, quant)
    w = C.read_fp8_weight(write("deepseek-v3", N, K)[0], NAME)
    with pytest.raises(ValueError, match="not every scale is a power of two"):
        C.convert_fp8_weight(w, "mxfp8")
    w = C.read_fp8_weight(write("compressed-tensors:FP8_DYNAMIC", N, K)[0], NAME)
    with pytest.raises(ValueError, match="vary within a 128x128 block"):
        C.convert_fp8_weight(w, "blockscale")


def _errors_of(cases):
    out = {}
    for label, call in cases.items():
        with pytest.raises(ValueError) as info:
            call()
        out[label] = str(info.value)
    return out


def test_formats_that_cannot_be_served_raise_naming_the_key_and_what_is_supported():
    t, config, _ = write("deepseek-v3", N, K)
    scale_key = NAME.replace(".weight", ".weight_scale_inv")
    q = t[NAME]
    other = lambda **kw: {**t, **kw}  # noqa: E731
    errors = _errors_of({
        "fnuz": lambda: C.read_fp8_weight(other(**{NAME: q.view(torch.uint8).view(torch.float8_e4m3fnuz)}), NAME),
        "e5m2": lambda: C.read_fp8_weight(other(**{NAME: q.float().to(torch.float8_e5m2)}), NAME),
        "packed-4bit": lambda: C.read_fp8_weight(other(**{NAME: q.view(torch.uint8)[:, :K // 2].contiguous()}), NAME),
        "float": lambda: C.read_fp8_weight(other(**{NAME: q.float()}), NAME),
        "no-scale": lambda: C.read_fp8_weight({NAME: q}, NAME),
        "missing-key": lambda: C.read_fp8_weight(t, "model.layers.1.mlp.down_proj.weight"),
        "scale-shape": lambda: C.read_fp8_weight(other(**{scale_key: torch.ones(N, 7)}), NAME),
        "scale-e4m3": lambda: C.read_fp8_weight(other(**{scale_key: t[scale_key].to(Q.FP8)}), NAME),
        "block-64": lambda: C.read_fp8_weight(t, NAME, config={**config, "weight_block_size": [64, 64]}),
        "config-says-rows": lambda: C.read_fp8_weight(t, NAME, config=ct_config(strategy="channel")),
        "float-groups": lambda: C.read_fp8_weight({NAME: q, NAME.replace(".weight", ".weight_scale"):
                                                   torch.full((N, K // 32), 0.3)}, NAME),
        "e8m0-nan": lambda: C.read_fp8_weight({NAME: q, NAME.replace(".weight", ".scale"):
                                               torch.full((2, 3), 255, dtype=torch.uint8).view(Q.E8M0)}, NAME),
        "two-scales": lambda: C.read_fp8_weight(other(**{NAME.replace(".weight", ".scale"): t[scale_key]}), NAME),
        # float scales that no quantizer writes: before, loaded, and every output reading them was NaN
        "nan-scale": lambda: C.read_fp8_weight(other(**{scale_key: t[scale_key].index_fill(1, torch.tensor([1]),
                                                                                         float("nan"))}), NAME),
        "inf-scale": lambda: C.read_fp8_weight(other(**{scale_key: torch.full_like(t[scale_key], float("inf"))}), NAME),
        "scale-fp64": lambda: C.read_fp8_weight(other(**{scale_key: t[scale_key].double()}), NAME),
    })
    expect = {"fnuz": ["float8_e4m3fnuz", "not OCP e4m3", "half the value", "float8_e4m3fn"],
              "e5m2": ["float8_e5m2", "supported:"],
              "packed-4bit": ["uint8", "4-bit"], "float": ["float32", "load_weight"],
              "no-scale": ["weight_scale_inv", "weight_scale", ".scale"], "missing-key": ["layers.1", "no tensor"],
              "scale-shape": ["[200, 7]", "[2, 3] (128x128 blocks)", "supported:"],
              "scale-e4m3": ["float8_e4m3fn [2, 3]", "not served"], "block-64": ["[64, 64]", "128x128"],
              "config-says-rows": ["channel", "block"], "float-groups": ["powers of two", "mxfp8"],
              "e8m0-nan": ["0xFF"], "two-scales": ["several scales", "weight_scale_inv", ".scale"],
              "nan-scale": ["2 of the scale's 6 values are NaN or infinite", "damaged"],
              "inf-scale": ["6 of the scale's 6 values"], "scale-fp64": ["float64", "fp32, bf16 or fp16"]}
    for label, words in expect.items():
        assert errors[label].startswith("read_fp8_weight: "), errors[label]
        if label not in ("missing-key",):
            assert NAME in errors[label], errors[label]
        for word in words:
            assert word in errors[label], (label, word, errors[label])
    # transformers' FineGrainedFP8Config: weight_block_size left out means 128x128, null one scale per tensor
    assert C.read_fp8_weight(t, NAME, config={"quant_method": "fp8"}).quant == "blockscale"
    with pytest.raises(ValueError, match="promises tensor scales but the tensor's shape is block scales"):
        C.read_fp8_weight(t, NAME, config={"quant_method": "fp8", "weight_block_size": None})


def test_a_split_that_leaves_a_rank_without_a_block_is_refused():
    """K=320 is 3 blocks of 128: world 4 would give rank 3 nothing; the error says the largest world
    that works. Per-row scales split K anywhere."""
    w = C.read_fp8_weight(write("deepseek-v3", N, K)[0], NAME)
    with pytest.raises(ValueError, match=r"K=320 is 3 block\(s\) of 128 .*world=4 leaves rank 3 .*at most 3"):
        C.shard_fp8_weight(w, rank=0, world=4, dim=1)
    with pytest.raises(ValueError, match=r"N=200 is 2 block\(s\) of 128 .*world=4 leaves ranks 2..3 .*at most 2"):
        C.shard_fp8_weight(w, rank=0, world=4, dim=0)
    rows = C.read_fp8_weight(write("compressed-tensors:FP8_DYNAMIC", N, K)[0], NAME)
    assert C.shard_fp8_weight(rows, rank=3, world=4, dim=1).shape == (N, 80)
    for bad in (dict(rank=2, world=2, dim=1), dict(rank=0, world=2, dim=2), dict(rank=0, world=0, dim=1)):
        with pytest.raises(ValueError, match="shard_fp8_weight: "):
            C.shard_fp8_weight(w, **bad)


# --------------------------------------------------------------------------------------------------
def _quantized_reference(x, w_full, quant, k_padded):
    """The layer's product on one rank: its activation quantizer, the loaded weight, fp32, bf16."""
    xp = torch.nn.functional.pad(x.float(), (0, k_padded - x.shape[1]))
    a, a_s = Q.quantize_a(xp, quant)
    wp = torch.nn.functional.pad(w_full, (0, k_padded - w_full.shape[1]))
    return (Q.dequantize_a(a, a_s, quant) @ wp.t()).to(torch.bfloat16)


def _layers_load(comm, path_by_fmt):
    from cco.nn import RowParallelLinear

    g = torch.Generator().manual_seed(3)
    results = {}

    def run(label, fmt, quant, k_layer, *, rank=0, world=1, requantize=False):
        path, config, full = path_by_fmt[fmt]
        layer = RowParallelLinear(k_layer, N, group=comm, quant=quant, m_max=16)
        try:
            layer.load_checkpoint(load_file(path), NAME, rank=rank, world=world, config=config, requantize=requantize)
        except ValueError as err:
            results[label] = str(err)
            return
        start = rank * k_layer
        piece = full[:, start:start + k_layer]
        x = torch.randn(9, k_layer, generator=g).to(torch.bfloat16)
        x[:, piece.shape[1]:] = 0  # a padded shard's missing input columns are zeros
        piece = torch.nn.functional.pad(piece, (0, k_layer - piece.shape[1]))
        with torch.no_grad():
            y = layer(x)
        results[label] = dict(y=y, w=layer.dequantized_weight(), piece=piece, x=x,
                              ref=_quantized_reference(x, piece, quant, layer.k_padded),
                              floatref=x.float() @ piece.t())

    for fmt, quant in FORMATS.items():
        run(fmt, fmt, quant, K)
    run("ue8m0-as-mxfp8", "deepseek-v3:ue8m0", "mxfp8", K)
    run("per-tensor-as-blockscale", "compressed-tensors:FP8", "blockscale", K)
    run("rank1-of-2-ragged", "deepseek-v3", "blockscale", 256, rank=1, world=2)
    run("mismatch", "compressed-tensors:FP8_DYNAMIC", "blockscale", K)
    run("requantized", "compressed-tensors:FP8_DYNAMIC", "blockscale", K, requantize=True)
    run("shard-not-whole-blocks", "deepseek-v3", "blockscale", 160, rank=0, world=2)
    run("fnuz", "fnuz", "blockscale", K)
    return results


@pytest.mark.multirank
def test_layers_load_each_format_and_multiply_like_the_dequantized_weight(tmp_path):
    """One CPU rank (world 1): every format into a layer of its quant, exact conversions into another
    quant, rank 1's padded ragged shard of world 2: the layer's weight is the checkpoint's exactly,
    its product is its quantized reference's (bf16 rounding) and ``x @ W.T`` within the activations'
    fp8 budget. A quant mismatch and a K shard not made of whole blocks raise, saying what to build;
    requantize=True serves the mismatch approximately; fnuz is refused."""
    paths = {fmt: saved(tmp_path, fmt, N, K) for fmt in FORMATS}
    t, config, full = write("deepseek-v3", N, K)
    t[NAME] = t[NAME].view(torch.uint8).view(torch.float8_e4m3fnuz)
    save_file(t, str(tmp_path / "fnuz.safetensors"))
    paths["fnuz"] = (str(tmp_path / "fnuz.safetensors"), config, full)
    (results,) = check_outcomes(spawn(_layers_load, world=1, args=(paths,), timeout_s=120))
    exact = [*FORMATS, "ue8m0-as-mxfp8", "per-tensor-as-blockscale", "rank1-of-2-ragged"]
    for label in exact:
        r = results[label]
        assert isinstance(r, dict), (label, r)
        assert torch.equal(r["w"], r["piece"]), label
        assert Q.count_mismatches(r["y"], r["ref"]) == 0 and Q.rel_l2(r["y"], r["ref"]) < Q.REL_L2_TOL["ptpc"], label
        assert Q.rel_l2(r["y"], r["floatref"]) < FP8_ACTIVATION_BUDGET, (label, Q.rel_l2(r["y"], r["floatref"]))
    assert results["rank1-of-2-ragged"]["piece"][:, 64:].abs().sum() == 0  # 64 real columns, the rest padding
    mismatch = results["mismatch"]
    for word in ("RowParallelLinear.load_checkpoint", NAME, "compressed-tensors:FP8_DYNAMIC", "quant='blockscale'",
                 "quant='ptpc'", "requantize=True", "lossy"):
        assert word in mismatch, (word, mismatch)
    r = results["requantized"]  # a second fp8 rounding: close to, not equal to, the checkpoint's weight
    assert not torch.equal(r["w"], r["piece"]) and Q.rel_l2(r["w"], r["piece"]) < 0.05
    assert Q.rel_l2(r["y"], r["floatref"]) < 2 * FP8_ACTIVATION_BUDGET
    for word in ("K=320", "world=2", "blocks of 128", "in_features_per_rank=160", "in_features_per_rank=256"):
        assert word in results["shard-not-whole-blocks"], (word, results["shard-not-whole-blocks"])
    assert "float8_e4m3fnuz" in results["fnuz"] and "not OCP e4m3" in results["fnuz"]


# --------------------------------------------------------------------------------------------------
def _tp2_layer(comm, path, config):
    from cco.nn import RowParallelLinear

    layer = RowParallelLinear(256, N, group=comm, quant="blockscale", m_max=16)
    layer.load_checkpoint(load_file(path), NAME, config=config)  # the group's rank and world
    g = torch.Generator().manual_seed(5)
    x = torch.randn(7, K_SHARDED, generator=g).to(torch.bfloat16)
    xr = torch.nn.functional.pad(x, (0, 2 * 256 - K_SHARDED))[:, comm.rank * 256:(comm.rank + 1) * 256]
    with torch.no_grad():
        return layer(xr), layer.dequantized_weight(), x


@pytest.mark.multirank
def test_two_ranks_each_load_their_own_shard_and_reduce_to_the_whole_product(tmp_path):
    """World 2 over gloo, K=448: rank 0 loads columns 0..255, rank 1 columns 256..447 padded to 256
    (its input padded with zeros). Every rank returns the same output; the sum over ranks is the
    quantized reference's and ``x @ W.T`` within the fp8 budget."""
    path, config, full = saved(tmp_path, "deepseek-v3", N, K_SHARDED)
    outs = check_outcomes(spawn(_tp2_layer, world=2, args=(path, config), timeout_s=120))
    (y0, w0, x), (y1, w1, _) = outs
    assert torch.equal(y0, y1)
    real = K_SHARDED - 256  # rank 1's columns of the checkpoint; the rest of its 256 is padding
    assert torch.equal(torch.cat([w0, w1[:, :real]], dim=1), full) and w1[:, real:].abs().sum() == 0
    xp = torch.nn.functional.pad(x, (0, 2 * 256 - K_SHARDED)).view(7, 2, 256)
    wp = torch.nn.functional.pad(full, (0, 2 * 256 - K_SHARDED)).view(N, 2, 256)
    ref = sum(_quantized_reference(xp[:, r], wp[:, r], "blockscale", 256).float() for r in range(2))
    ref = ref.to(torch.bfloat16)
    assert Q.count_mismatches(y0, ref) == 0 and Q.rel_l2(y0, ref) < Q.REL_L2_TOL["blockscale"]
    assert Q.rel_l2(y0, x.float() @ full.t()) < FP8_ACTIVATION_BUDGET


# --------------------------------------------------------------------------------------------------
def _column_loads(comm, path, config):
    from cco.nn import ColumnParallelLinear

    results = {}
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    layer = ColumnParallelLinear(K, 128, group=comm, quant="blockscale", m_max=16)
    layer.load_checkpoint(load_file(path), NAME, rank=1, world=2, config=config)  # N rows 128..199, padded
    with torch.no_grad():
        results["exact"] = dict(w=layer.dequantized_weight(), y=layer(x))
    layer = ColumnParallelLinear(K, 128, group=comm, quant="ptpc", m_max=16)
    layer.load_checkpoint(load_file(path), NAME, rank=1, world=2, config=config, requantize=True)
    results["requantized"] = dict(w=layer.dequantized_weight())
    for label, n_r in (("not-whole-blocks", 100),):
        layer = ColumnParallelLinear(K, n_r, group=comm, quant="blockscale", m_max=16)
        try:
            layer.load_checkpoint(load_file(path), NAME, rank=0, world=2, config=config)
            results[label] = "loaded"
        except ValueError as err:
            results[label] = str(err)
    layer = ColumnParallelLinear(K + 128, 128, group=comm, quant="blockscale", m_max=16)
    try:
        layer.load_checkpoint(load_file(path), NAME, rank=0, world=2, config=config)
        results["other-k"] = "loaded"
    except ValueError as err:
        results["other-k"] = str(err)
    return results, x


@pytest.mark.multirank
def test_a_column_layer_loads_its_n_shard(tmp_path):
    """``ColumnParallelLinear.load_checkpoint`` shards N (dim 0): rank 1 of 2 of N=200 holds rows
    128..199 of the checkpoint exactly, padded with zero rows, and multiplies like them within the
    fp8 budget; requantize=True takes the same rows approximately; a per-rank N that is not the
    whole-block shard width, and another K, raise naming what to build."""
    path, config, full = saved(tmp_path, "deepseek-v3", N, K)
    ((results, x),) = check_outcomes(spawn(_column_loads, world=1, args=(path, config), timeout_s=120))
    real = N - 128
    exact = results["exact"]
    assert torch.equal(exact["w"][:real], full[128:]) and exact["w"][real:].abs().sum() == 0
    assert Q.rel_l2(exact["y"][:, :real], x.float() @ full[128:].t()) < FP8_ACTIVATION_BUDGET
    assert exact["y"][:, real:].abs().sum() == 0
    w = results["requantized"]["w"]
    assert not torch.equal(w[:real], full[128:]) and Q.rel_l2(w[:real], full[128:]) < 0.05
    assert w[real:].abs().sum() == 0
    for word in ("ColumnParallelLinear.load_checkpoint", "N=200", "out_features_per_rank=100",
                 "out_features_per_rank=128"):
        assert word in results["not-whole-blocks"], (word, results["not-whole-blocks"])
    assert "320 input features" in results["other-k"] and "in_features=448" in results["other-k"], results["other-k"]
