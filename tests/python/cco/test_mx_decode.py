"""mxfp8's decode GEMM over its fp8 weight (``kernels_fused.hopper.mx_decode``, CUDA C++), on the
host: its byte arithmetic replayed (the e4m3 -> bf16 conversion by integer work and the power-of-two
multiplier give every e4m3 value times every scale the kernel takes exactly; the K order its A and B
fragments share covers each block once and makes the MMA's sum the dot product), every build
compiles for sm_90a without spills, and the launcher refuses what the kernel does not cover before
it touches a GPU. Not run here (no GPU): ``scripts.probe_mx_decode`` checks its products against the
fp32 product on the GPU and times it."""

import re

import pytest
import torch

from cco import quant as Q
from kernels_fused.hopper import cubin
from kernels_fused.hopper import mx_decode as X

needs_nvcc = pytest.mark.skipif(cubin.nvcc() is None, reason="nvcc builds this kernel (the GPU machines have it)")


def _bf16_of(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float().item()


def _fma_bf16(a: float, b: float) -> float:
    """bf16 a * b rounded once to nearest even (fma.rn.bf16x2 with a -0 addend): the product of two
    bf16 values is exact in fp64, and its fp32 is exact wherever fp32 holds it (down to 2^-149)."""
    return torch.tensor(a * b, dtype=torch.float64).float().to(torch.bfloat16).double().item()


def test_every_e4m3_byte_times_every_taken_scale_is_the_bf16_copys_value():
    """The kernel's weight value is the bf16 (round to nearest even) of the exact dequantized value,
    the value of the weight's bf16 copy that cuBLAS's path reads, for every byte and every scale it
    takes; from a scale of 3 (2^-124) up it is the exact value (below, e4m3's smallest values fall
    under bf16's smallest subnormal, 2^-133, and round as the copy's do)."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(torch.float8_e4m3fn).double()
    for e in range(0, X.MAX_SCALE + 1):
        mult = _bf16_of((e + 120) << 7)
        assert mult == 2.0 ** (e - 7)
        exact = values * 2.0 ** (e - 127)
        copy = exact.float().to(torch.bfloat16).double()  # (the fp32 product is exact: fp32 reaches 2^-149)
        for b in range(256):
            if b & 0x7F == 0x7F:  # e4m3fn's NaN: quantized weights never hold it (the quantizer saturates)
                continue
            lo, _ = X.bf16_pairs(b)  # byte 0 of the word
            got = _fma_bf16(_bf16_of(lo & 0xFFFF), mult)
            assert got == copy[b].item(), (b, e, got, copy[b].item())
            if e >= 3:
                assert got == exact[b].item(), (b, e)


def test_the_two_pairs_of_a_word_take_bytes_0_1_and_2_3():
    word = 0x38_40_C0_30  # bytes 0x30, 0xC0, 0x40, 0x38
    lo, hi = X.bf16_pairs(word)
    values = torch.tensor([0x30, 0xC0, 0x40, 0x38], dtype=torch.uint8).view(torch.float8_e4m3fn).float() * 2.0 ** -120
    got = [_bf16_of(lo & 0xFFFF), _bf16_of(lo >> 16), _bf16_of(hi & 0xFFFF), _bf16_of(hi >> 16)]
    assert got == values.tolist()


def test_the_shared_k_order_covers_each_block_once_and_the_fragments_give_the_dot_product():
    """Lane (g, t)'s A fragment (rows g and g + 8) and B fragment (token g) take the same physical k for
    each logical k of m16n8k16 (PTX's fragment layout): the four MMA steps of a 64-wide block then sum
    every physical k once, so their C equals A @ B.T over the block."""
    assert sorted(X.k_order(t, s, j) for t in range(4) for s in range(4) for j in range(4)) == list(range(64))
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(16, 64, generator=gen, dtype=torch.float64)
    b = torch.randn(8, 64, generator=gen, dtype=torch.float64)
    c = torch.zeros(16, 8, dtype=torch.float64)
    logical = {0: 0, 1: 1, 2: 8, 3: 9}  # fragment element j -> logical k offset from 2t
    for s in range(4):
        # the step's operands by logical k, filled lane by lane as the kernel's registers are
        a_step = torch.full((16, 16), float("nan"), dtype=torch.float64)
        b_step = torch.full((16, 8), float("nan"), dtype=torch.float64)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for j in range(4):
                kk, phys = 2 * t + logical[j], X.k_order(t, s, j)
                a_step[g, kk], a_step[g + 8, kk] = a[g, phys], a[g + 8, phys]
                b_step[kk, g] = b[g, phys]
        assert not (a_step.isnan().any() or b_step.isnan().any())  # every fragment element was set
        c += a_step @ b_step
    assert torch.allclose(c, a @ b.t(), rtol=0, atol=1e-12)


@needs_nvcc
@pytest.mark.parametrize("slices, tiles", [(s, X.TILES) for s in X.SLICES] + [(8, 1)])
def test_every_build_compiles_without_spills(slices, tiles, tmp_path):
    report = cubin.ptxas_report(X.SOURCE, X.defines(slices=slices, tiles=tiles), str(tmp_path))
    assert sorted(report) == sorted(f"cco_mx_decode_{t}" for t in X.TOKEN_TILES)
    for name, r in report.items():
        assert r["spill_stores"] == r["spill_loads"] == 0, (name, r)
        assert r["registers"] <= 255, (name, r)
    assert X.shared_bytes(X.M_MAX, tiles=tiles) <= 227 * 1024


def test_the_partials_fit_in_the_shared_memory_they_reuse():
    """The cluster's sum keeps each block's fp32 partial ([8 x token tiles] rows of kRedStride floats,
    the block's rows + 4) in the shared memory of its activation stages: the launch asks for the
    larger of the two."""
    for m in (1, 8, 9, 33, 64):
        for stages in (2, 3):
            for tiles in (1, 2):
                need = X.token_tiles(m) * 8 * (X.block_rows(tiles) + 4) * 4
                assert need <= X.shared_bytes(m, stages, tiles)
    assert X.shared_bytes(64, 3, 2) == 3 * 64 * X.ROW_BYTES  # (the stages are the larger at the default)


def _operands(m=8, n=256, k=512):
    w, ws = Q.quantize_b(torch.randn(n, k), "mxfp8")
    return torch.zeros(m, k, dtype=torch.bfloat16), w, ws


@pytest.mark.parametrize("change, match", [
    (dict(m=65), "1..64 rows"), (dict(n=192), "N % 128"), (dict(k=448), "K % 128")])
def test_shapes_outside_the_kernel_are_refused_before_any_launch(change, match):
    kw = dict(m=8, n=256, k=512) | change
    x = torch.zeros(kw["m"], kw["k"], dtype=torch.bfloat16)
    w = torch.zeros(kw["n"], kw["k"], dtype=torch.float8_e4m3fn)
    ws = torch.zeros(kw["n"], kw["k"] // 32, dtype=torch.uint8)
    with pytest.raises(ValueError, match=match):
        X.mx_decode_gemm(x, w, ws)


def test_other_dtypes_and_a_scale_past_the_multiplier_are_refused():
    x, w, ws = _operands()
    with pytest.raises(ValueError, match="bf16 rows"):
        X.mx_decode_gemm(x.float(), w, ws)
    with pytest.raises(ValueError, match="contiguous scales"):
        X.mx_decode_gemm(x, w, ws[:, :8])
    big = ws.view(torch.uint8).clone()
    big[3, 5] = X.MAX_SCALE + 1
    with pytest.raises(ValueError, match="scales up to"):
        X.mx_decode_gemm(x, w, big)
    X.check_scales(ws)  # a weight quantized from unit values is far inside the bound


def test_slices_follow_the_grid_and_keep_two_steps():
    assert X.default_slices(4096, 14336, 132) == 8      # 32 row blocks: 256 blocks
    assert X.default_slices(8192, 28672, 132) == 4      # 64 row blocks
    assert X.default_slices(1024, 4096, 132) == 8       # 8 row blocks: the cluster's most
    assert X.default_slices(4096, 512, 132) == 2        # 4 steps: two slices of two
    assert X.default_slices(4096, 256, 132) == 1
    assert [X.token_tiles(m) for m in (1, 8, 9, 16, 17, 33, 64)] == [1, 1, 2, 2, 4, 8, 8]
    x, w, ws = _operands(k=512)
    with pytest.raises(ValueError, match="K slices of"):
        X.mx_decode_gemm(x, w, ws, slices=4)            # 4 steps: one each
    with pytest.raises(ValueError, match="K slices of"):
        X.mx_decode_gemm(x, w, ws, slices=3)


def test_a_build_is_loaded_once_and_a_kernels_shared_allowance_only_grows(monkeypatch, tmp_path):
    """``cubin.function`` on a fake driver: the four token-tile kernels of one build share one loaded
    module, a second ask for a kernel is the kept handle, and a larger shared-memory ask raises that
    kernel's allowance (a smaller one leaves it)."""
    calls = []

    class Driver:
        def cuModuleLoadData(self, module, image):
            calls.append(("load", image))
            return 0

        def cuModuleGetFunction(self, fn, module, name):
            calls.append(("get", name))
            return 0

        def cuFuncSetAttribute(self, fn, attribute, value):
            calls.append(("shared", value))
            return 0

    image = tmp_path / "k.cubin"
    image.write_bytes(b"cubin")
    monkeypatch.setattr(cubin, "driver", Driver)
    monkeypatch.setattr(cubin, "build", lambda src, defines: str(image))
    monkeypatch.setattr(cubin, "_modules", {})
    monkeypatch.setattr(cubin, "_functions", {})
    for t in X.TOKEN_TILES:
        cubin.function(0, X.SOURCE, X.defines(), f"cco_mx_decode_{t}".encode(), X.shared_bytes(8 * t))
    assert [c for c in calls if c[0] == "load"] == [("load", b"cubin")]
    assert len([c for c in calls if c[0] == "get"]) == len(X.TOKEN_TILES)
    calls.clear()
    cubin.function(0, X.SOURCE, X.defines(), b"cco_mx_decode_8", X.shared_bytes(64))
    cubin.function(0, X.SOURCE, X.defines(), b"cco_mx_decode_8", 1024)
    assert calls == []
    cubin.function(0, X.SOURCE, X.defines(), b"cco_mx_decode_8", X.shared_bytes(64) + 16)
    assert calls == [("shared", X.shared_bytes(64) + 16)]
    cubin.function(1, X.SOURCE, X.defines(), b"cco_mx_decode_8", 1024)  # another device: its own load
    assert calls[1:] == [("load", b"cubin"), ("get", b"cco_mx_decode_8"), ("shared", 1024)]


def test_the_launchs_arguments_follow_the_kernels_parameters():
    """Launch.args (and so the decode path's C++ plans, native.describe_function) lay the operands out
    in the order and width of the kernels' parameter list in the source."""
    with open(X.SOURCE) as f:
        source = f.read()
    params = re.search(r"cco_mx_decode_##TOK\(([^)]*)\)", source)[1].replace("\\", " ").split(",")
    names = [p.split()[-1].lstrip("*") for p in params]
    ints = tuple(i for i, p in enumerate(params) if p.split()[-2] == "int")
    assert names == ["x", "ldx", "w", "ws", "bias", "out", "ldo", "m", "n", "k"]
    assert ints == X.INT_ARGS
    launch = object.__new__(X.Launch)
    launch.ints = (8, 1000, 512)
    laid = launch.args("x", 512, "w", "ws", "bias", "out", 1000)
    assert [laid[names.index(n)] for n in ("x", "w", "ws", "bias", "out")] == ["x", "w", "ws", "bias", "out"]
    assert [laid[i] for i in ints] == [512, 1000, 8, 1000, 512]


def test_a_planned_cuda_cpp_launch_has_pointer_roles_and_32_bit_integers():
    from kernels_fused.hopper import native as NV

    P = NV.Pointer
    fn, grid, threads, shared, cooperative, params = NV.describe_function(
        1234, (8, 2, 1), 128, 52224, [P(NV.SCRATCH), 512, P(NV.W), P(NV.SCALE), P(NV.NULL), P(NV.OUT), -1])
    assert (fn, grid, threads, shared, cooperative) == (1234, (8, 2, 1), 128, 52224, False)
    assert params == [(NV.POINTER, NV.SCRATCH, 0), (NV.BITS32, 512, 0), (NV.POINTER, NV.W, 0),
                      (NV.POINTER, NV.SCALE, 0), (NV.POINTER, NV.NULL, 0), (NV.POINTER, NV.OUT, 0),
                      (NV.BITS32, 0xFFFFFFFF, 0)]  # (no Triton scratch pointers appended)
    with pytest.raises(ValueError, match="float"):
        NV.describe_function(1, (1,), 128, 0, [1.5])


def test_the_layers_rule_and_its_switch(monkeypatch):
    from kernels_fused.hopper import decode as D

    assert [D.mx_rows_max(k) for k in (512, 2048, 4096, 14336)] == [16, 16, 32, 32]
    assert D.MX_ROWS_MAX <= X.M_MAX
    monkeypatch.setattr(D, "MX", False)
    assert D.mx_rows_max(14336) == 0


def test_a_weight_the_kernel_cannot_take_says_why():
    x, w, ws = _operands()
    assert X.unsuited(w, ws) is not None  # (a CPU tensor: not an sm_90 GPU)
    with pytest.raises(ValueError, match="stores 1..256"):
        X.check_shapes(8, w, ws, 257)
    with pytest.raises(ValueError, match="e4m3 weight"):
        X.check_shapes(8, w.view(torch.uint8), ws, 256)
    X.check_shapes(64, w, ws, 200)  # the first 200 features of 256 rows


@pytest.mark.parametrize("error", [RuntimeError("nvcc failed on mx_decode.cu"),
                                   PermissionError(13, "Permission denied", "/readonly/.cache/cco")])
def test_a_build_that_cannot_be_made_is_warned_and_said_not_raised(monkeypatch, error):
    """A failed nvcc or driver call, or a cache folder the job cannot write (a read-only home), leaves
    the weight on its bf16 copy with a warning: the decode call must not raise for it."""
    def failing(*args, **kwargs):
        raise error

    monkeypatch.setattr(X, "Launch", failing)
    with pytest.warns(RuntimeWarning, match="bf16 copy"):
        why = X.unloaded(0, 4096, 14336)
    assert why.startswith("the build failed") and type(error).__name__ in why


def test_a_launch_runs_in_its_kernels_devices_context(monkeypatch):
    """The driver launches in the current context, and the kernel was loaded into its device's: a
    process driving several GPUs that calls with another device current must get that device's
    context for the launch (as the Triton launches do), and no context switch where it is current."""
    import contextlib

    current, seen = [0], []

    @contextlib.contextmanager
    def device(index):
        before, current[0] = current[0], index
        try:
            yield
        finally:
            current[0] = before

    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current[0], raising=False)  # (a CPU build has none)
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(X.cubin, "launch", lambda fn, grid, threads, shared, stream, args: seen.append(
        (current[0], fn, len(args))))
    launch = object.__new__(X.Launch)
    launch.fn, launch.grid, launch.shared, launch.ints, launch.device = "fn", (32, 8, 1), 1024, (8, 4096, 14336), 1
    x, w, ws = torch.zeros(8, 128, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.uint8), torch.zeros(1)
    launch(x, w, ws, None, torch.zeros(8, 64, dtype=torch.bfloat16), 0)
    current[0] = 1
    launch(x, w, ws, None, torch.zeros(8, 64, dtype=torch.bfloat16), 0)
    assert seen == [(1, "fn", 10), (1, "fn", 10)] and current[0] == 1
