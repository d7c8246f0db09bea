"""``cco.nn.RowParallelLinear`` and the torch.library ops on NVIDIA GPUs, at the world torchrun starts.

The checks run in rank processes started by torchrun; the pytest test launches them where there is
an NVIDIA GPU and is skipped elsewhere (the CPU path is covered by test_nn_linear.py,
test_library.py and test_activation_quant.py). By hand::

    torchrun --nproc-per-node 2 -m tests.python.cco.test_cuda_nn

With one GPU both ranks share it through a CUDA IPC window: the checks hold, speed is not measured.

Guards, per check:
- the Triton activation quantizer gives the bytes of ``quantize_a`` on the host (every quant, K
  padded and not, M past a program's rows);
- the layer, every quant, N and K padded (1000 -> 1024 outputs, 300 -> 384 inputs per rank),
  against the unfused model's error budget, on every rank; its weight reaches the kernel without an
  unshuffle per call (two layers sharing one op, called in turn);
- ``torch.compile(fullgraph=True)`` (inductor) around the layer gives the eager bytes; the
  compiled function captured in a CUDA graph and replayed with changing inputs into a NaN-poisoned
  output; ``mode="reduce-overhead"`` (inductor's CUDA graphs); for the lsa kernel and the copy
  engines (transports auto and dma);
- the backward of a trainable layer, eager and compiled, gives the unfused model's gradients;
- the decode GEMM (``kernels_fused.hopper.decode``, calls of a few rows with no communication: a
  column-parallel layer's local GEMM, a row-parallel layer of one rank), every quant, with a bias,
  N and K padded: within the fp8 GEMM's error budget of the fp32 product of the quantizer's
  operands (``cco.bench.timing.gemm_mismatches``), the bias the layer's ``out += bias``; its compiled-kernel launch gives ``JITFunction.run``'s bytes; the layer's call
  compiled, and captured in a CUDA graph replayed on new rows, gives the eager bytes;
- ptpc's one-launch decode GEMM (2..64 rows, a grid-wide wait inside) gives the two launches'
  bytes, and without its wait reads rows not yet written (the race shown, then shown gone);
- a rank's own work failing inside a call (rank 1's quantizer, once) fails that call on both ranks
  (``PeerRejectedError`` on rank 0) and the next call is right, on the lsa kernel and the copy
  engines (its code dry-run on two CPU ranks in test_local_failures.py, beside the CPU cases);
- a rank's rows on another device than the layer's (rank 1's on the CPU, eagerly and through the
  registered op) fail that call on both ranks, and the next call is right.
"""

from __future__ import annotations

import time

import pytest
import torch

from tests.python.cco.torchrun_checks import nvidia_gpus, run_rank_checks

N, K_RANK, M_MAX = 1000, 300, 256  # padded on a GPU backend at world 2: N 1024, K 384
LEAD = (4, 50)  # 200 rows
REPLAYS = 20
DECODE_MS = (1, 2, 3, 4, 17, 40, 64)  # rows of the decode GEMM's checks: one row, the rows kernels, ptpc's wide MMA


@pytest.mark.cuda
@pytest.mark.skipif(nvidia_gpus() < 1, reason="needs an NVIDIA GPU (two ranks share one if there is only one); the "
                    "CPU path is covered by test_nn_linear.py and test_library.py")
def test_cuda_nn_world2_under_torchrun():
    run_rank_checks("tests.python.cco.test_cuda_nn", "CUDA_NN_CHECKS PASSED")


# --------------------------------------------------------------------------------------------------
# rank side (torchrun)
# --------------------------------------------------------------------------------------------------
def _inputs(rank: int, seed: int):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randn(*LEAD, K_RANK, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K_RANK, generator=g) * torch.exp2(torch.randint(-2, 3, (N, 1), generator=g).float()))
    return x, w.to(torch.bfloat16)


def _budget(comm, layer, seed: int):
    """The all-reduce reference of every rank's inputs (collective over the group, summed on the
    host: the ranks may share a GPU): (fp32 sum of partials, sum of |partials|, sum of |A| @ |B|.T).
    Each rank's partial multiplies its input quantized on the host (``quantize_a``, which the
    kernel matches bit for bit: ``check_quantizer``) by the weight the layer stores."""
    from cco import quant as Q
    from cco.bench.timing import allreduce_terms

    x = _inputs(comm.rank, seed)[0].reshape(-1, K_RANK).float()
    a, a_s = Q.quantize_a(torch.nn.functional.pad(x, (0, layer.k_padded - K_RANK)), layer.quant)
    a = Q.dequantize_a(a, a_s, layer.quant)[:, :K_RANK]
    w = layer.dequantized_weight().cpu()
    return allreduce_terms(a @ w.t(), a.abs() @ w.abs().t(), comm.group, on_host=True)


def _bad(out, ref) -> int:
    from cco.bench.timing import allreduce_mismatches

    return allreduce_mismatches(out.reshape(-1, N).cpu(), *ref, fp8_gather=False)


def _layer(comm, quant, *, transport=None, trainable=False, wseed=0):
    from cco.nn import RowParallelLinear

    layer = RowParallelLinear(K_RANK, N, group=comm, quant=quant, m_max=M_MAX, transport=transport,
                              trainable=trainable)  # transport None: the backend's default
    layer.load_weight(_inputs(comm.rank, wseed)[1].to(comm.device))
    return layer


def check_quantizer(comm, log):
    from cco import quant as Q
    from kernels_fused.hopper import launch as L
    from kernels_fused.hopper import vendor
    from kernels_fused.hopper.quantize import quantize_activation

    for quant in Q.QUANTS:
        for m, k, k_pad in ((1, 2048, 2048), (37, 2368, 2432), (1000, 7168, 7168), (5, 300, 384)):
            x = torch.randn(m, k, device=comm.device).to(torch.bfloat16)
            x[:, 0] *= 300.0  # an outlier per row: the rest of a ptpc row near e4m3's subnormals
            # zeros and negative zeros (quantized without a division: their bytes, sign bit too), a zero group
            x[:, 3::7], x[:, 5::11], x[m // 2, 128:256] = 0.0, -0.0, -0.0
            q, s = (t.cpu() for t in quantize_activation(x, quant, k_padded=k_pad))  # JITFunction.run
            # again through the kept launch (kernels_fused.hopper.launch), and on a strided view of the
            # same rows 8 bytes off 16-byte alignment (another key): the same bytes
            wide = torch.zeros(m, k + 12, dtype=x.dtype, device=x.device)
            wide[:, 4:4 + k] = x
            for again in (x, x, wide[:, 4:4 + k]):
                q2, s2 = (t.cpu() for t in quantize_activation(again, quant, k_padded=k_pad))
                if not (torch.equal(q2.view(torch.uint8), q.view(torch.uint8))  # bytes: NaN or -0 compare too
                        and torch.equal(s2.contiguous().view(torch.uint8), s.contiguous().view(torch.uint8))):
                    raise AssertionError(f"quantizer {quant} {m}x{k}->{k_pad}: a kept launch (row stride "
                                         f"{again.stride(0)}) differs from the first call's bytes")
            # on the host: torch's CUDA division by a scalar multiplies by its reciprocal, so
            # quantize_a of a CUDA tensor can move a scale by one ulp; the kernel divides exactly
            rq, rs = Q.quantize_a(torch.nn.functional.pad(x.cpu().float(), (0, k_pad - k)), quant)
            bad = int((q.view(torch.uint8) != rq.view(torch.uint8)).sum())
            same_scales = torch.equal(s.view(torch.uint8), rs.view(torch.uint8)) if quant == "mxfp8" else torch.equal(s, rs)
            if bad or not same_scales:
                raise AssertionError(f"quantizer {quant} {m}x{k}->{k_pad}: {bad} e4m3 bytes or the scales differ")
            if quant == "mxfp8":  # the vendor path's dequantization: kept launch == JITFunction.run, bit for bit
                q, s = quantize_activation(x, quant, k_padded=k_pad)
                kept = [vendor.mx_to_bf16(q, s) for _ in range(2)]
                L.FAST_LAUNCH = False
                slow = vendor.mx_to_bf16(q, s)
                L.FAST_LAUNCH = True
                if not all(torch.equal(y.view(torch.int16), slow.view(torch.int16)) for y in kept):
                    raise AssertionError(f"mx_to_bf16 {m}x{k_pad}: the kept launch differs from JITFunction.run")
    log("ok quantizer: Triton bytes == quantize_a bytes on the host (every quant, K padded and not, zeros and "
        "negative zeros among the values); kept launches "
        "and a strided, unaligned view give the same bytes; mx_to_bf16's kept launch == JITFunction.run")


def check_layers(comm, log):
    from cco import quant as Q

    for quant in Q.QUANTS:
        layer = _layer(comm, quant)
        x = _inputs(comm.rank, 1)[0].to(comm.device)
        out = layer(x)
        bad = _bad(out, _budget(comm, layer, 1))
        if bad:
            raise AssertionError(f"layer {quant}: {bad} elements outside the budget")
        if layer.op is None or layer.op.config.weight_layout != "row-major" or layer.n_padded != 1024:
            raise AssertionError(f"layer {quant}: expected the fused path, row-major weight, N padded: {layer!r}")
        log(f"ok layer {quant:10s} eager, N 1000->1024, K 300->384: 0 bad elements; {layer!r}")
        layer.close()
    # two layers of one family take turns on one op; neither weight is ever unshuffled
    a, b = _layer(comm, "ptpc", wseed=0), _layer(comm, "ptpc", wseed=2)
    if a.op is not b.op:
        raise AssertionError("two layers of one shape did not share their op")
    x = _inputs(comm.rank, 1)[0].to(comm.device)
    import cco.backends.cuda as cuda_backend

    unshuffled = []  # every weight the backend unshuffles passes through its module's unshuffle_b
    real = cuda_backend.unshuffle_b
    cuda_backend.unshuffle_b = lambda b: unshuffled.append(tuple(b.shape)) or real(b)
    try:
        for layer in (a, b, a, b):
            if _bad(layer(x), _budget(comm, layer, 1)):
                raise AssertionError("shared op: a layer's output used the other layer's weight")
    finally:
        cuda_backend.unshuffle_b = real
    if unshuffled:
        raise AssertionError(f"the backend unshuffled a row-major weight {len(unshuffled)} time(s): {unshuffled}")
    log("ok two layers on one op, called in turn: each its own weight, no unshuffled copy kept")
    a.close()
    b.close()



def _verdict(comm, layer, seed: int, before=None):
    """(``"N bad"``: elements of ``layer``'s output on the inputs of ``seed`` outside the budget, or
    the error's type name; the error or None). ``before()`` runs after the reference, before the
    call. Collective: every rank, every call (the reference is)."""
    ref = _budget(comm, layer, seed)
    if before is not None:
        before()
    try:
        out = layer(_inputs(comm.rank, seed)[0].to(comm.device))
        layer.op.check()
        return f"{_bad(out, ref)} bad", None
    except Exception as err:
        return type(err).__name__, err


class LocalFault(RuntimeError):
    """The simulated failure of one rank's own work inside a call (a CUDA out-of-memory, say)."""


def arm_local_fault(comm, targets, ranks=(1,)):
    """Make each ``(owner, name)`` of ``targets`` raise :class:`LocalFault` at its next call on the
    ``ranks`` once ``arm()`` is called, once; returns ``(arm, restore)`` (``restore()`` puts the real
    ones back). Shared with test_local_failures.py's CPU cases."""
    state, reals = {"armed": False}, [(owner, name, getattr(owner, name)) for owner, name in targets]

    def faulty(name, real):
        def call(*args, **kwargs):
            if state["armed"]:
                state["armed"] = False
                raise LocalFault(f"rank {comm.rank}: {name} failed on this rank alone (simulated)")
            return real(*args, **kwargs)
        return call

    for owner, name, real in reals:
        setattr(owner, name, faulty(name, real))

    def arm():
        state["armed"] = comm.rank in ranks

    def restore():
        for owner, name, real in reals:
            setattr(owner, name, real)
    return arm, restore


def check_local_failure(comm, log):
    """Rank 1's own work failing inside a call (its activation quantizer, once: an out-of-memory there,
    say) fails that call on both ranks, rank 0 with ``PeerRejectedError`` (from the call or
    ``check()``: rank 1 took part as a rejected call, on the device's NaN operands), and the calls
    after it are right, for the lsa kernel and the copy engines (tests/python/cco/test_local_failures.py
    on the CPU)."""
    import cco.nn.linear as linear
    from cco.nn import RowParallelLinear

    arm, restore = arm_local_fault(comm, [(linear, "quantize_activation")])
    try:
        for transport in ("lsa", "dma"):
            layer = RowParallelLinear(K_RANK, N, group=comm, quant="ptpc", m_max=M_MAX, transport=transport,
                                      deadline_s=20)
            layer.load_weight(_inputs(comm.rank, 0)[1].to(comm.device))
            got = [_verdict(comm, layer, seed, before=arm if seed == 12 else None)[0] for seed in (11, 12, 13)]
            want = ["0 bad", "LocalFault" if comm.rank == 1 else "PeerRejectedError", "0 bad"]
            if got != want:
                raise AssertionError(f"local failure, transport {transport}: calls gave {got}, expected {want}")
            log(f"ok rank 1's quantizer failing once ({transport}): {got} on rank {comm.rank}, the next call right")
            layer.close()
    finally:
        restore()


def check_wrong_device(comm, log):
    """Rank 1 passing its rows on the CPU to the CUDA layer (eagerly, and with a gradient recorded:
    through the registered op) fails that call on both ranks, rank 1 with a ``ValueError`` that names
    both devices, rank 0 with ``PeerRejectedError``; the next call is right, on the lsa kernel and the
    copy engines (test_nn_sequence.py: meta rows on CPU ranks)."""
    from cco.nn import RowParallelLinear

    problems = []
    for transport in ("lsa", "dma"):
        layer = RowParallelLinear(K_RANK, N, group=comm, quant="ptpc", m_max=M_MAX, transport=transport,
                                  trainable=True, deadline_s=20)
        layer.load_weight(_inputs(comm.rank, 0)[1].to(comm.device))
        for grad in (False, True):
            got = []
            for seed in (21, 22, 23):
                ref = _budget(comm, layer, seed)
                x = _inputs(comm.rank, seed)[0]
                x = x if seed == 22 and comm.rank == 1 else x.to(comm.device)
                try:
                    with torch.set_grad_enabled(grad):
                        out = layer(x.requires_grad_(grad))
                    layer.op.check()
                    got.append(f"{_bad(out.detach(), ref)} bad")
                except Exception as err:
                    # (a peer's PeerRejectedError, a ValueError too, quotes the message)
                    named = type(err) is ValueError and "x is on cpu but the layer" in str(err)
                    got.append(type(err).__name__ + (" naming the devices" if named else ""))
            want = ["0 bad", "ValueError naming the devices" if comm.rank == 1 else "PeerRejectedError", "0 bad"]
            if got != want:  # raised after every case: a rank that stopped early would leave its peer waiting
                problems.append(f"transport {transport}, grad {grad}: calls gave {got}, expected {want}")
            else:
                log(f"ok rank 1's rows on the CPU ({transport}, grad {grad}): {got} on rank {comm.rank}")
        layer.close()
    if problems:
        raise AssertionError(f"wrong device on rank {comm.rank}: " + "; ".join(problems))


def check_layers_called_apart(comm, log):
    """Two layers of one family (one op): rank 0 calling one while rank 1 calls the other fails
    that call on both ranks with PeerMismatchError naming the two layers (from the call or
    ``check()``: the device compares the (seq, tag, M) stamps whole), for the lsa kernel and the
    copy engines, and the calls after it are right (tests/python/cco/test_nn_linear.py on the CPU:
    before the tag, both ranks returned a sum of the two layers' products with no error)."""
    for transport in ("lsa", "dma"):
        a, b = (_layer(comm, "ptpc", transport=transport, wseed=s) for s in (0, 2))
        if a.op is not b.op:
            raise AssertionError("two layers of one shape did not share their op")
        got = []
        for seed, (mine, theirs) in ((11, (a, a)), (12, (a, b)), (13, (b, b))):
            verdict, err = _verdict(comm, mine if comm.rank == 0 else theirs, seed)
            if err is not None and "layer" not in str(err):
                raise AssertionError(f"layers called apart ({transport}): the error names no layer: {err}")
            got.append(verdict)
        if got != ["0 bad", "PeerMismatchError", "0 bad"]:
            raise AssertionError(f"layers called apart, transport {transport}: calls gave {got} on rank {comm.rank}")
        log(f"ok two layers of one op called apart ({transport}): {got} on rank {comm.rank}, the next call right")
        a.close()
        b.close()


def check_calls_across_the_seq_wrap(comm, log):
    """Calls of an op whose calls so far number 2**31 - 3, across the stamp's seq range (it cycles
    the seq through 1 .. 2**31 - 1; before, call 2**31 made a stamp word past int64), on the lsa kernel and
    the copy engines: every call right (tests/python/cco/test_op_cpu.py on the CPU)."""
    for transport in ("lsa", "dma"):
        layer = _layer(comm, "ptpc", transport=transport)
        layer.op._seq = 2**31 - 3  # the calls before, as if made (the CUDA window keeps no seq of them)
        got = [_verdict(comm, layer, seed)[0] for seed in range(21, 26)]
        if got != ["0 bad"] * 5 or layer.op.calls != 2**31 + 2:
            raise AssertionError(f"across the seq wrap ({transport}): the calls gave {got}, calls "
                                 f"{layer.op.calls}")
        log(f"ok calls 2**31 - 2 .. 2**31 + 2 ({transport}): 0 bad elements each")
        layer.close()


def captured(fn, *, sync=None):
    """``(graph, output)``: ``fn()`` run once on a side stream (what a capture must not be the first
    to do: compile, plan, keep launches), then captured into a CUDA graph. ``sync()``, where given,
    runs between the two (the ranks' barrier, when every rank must be past its warm-up first)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    if sync is not None:
        torch.cuda.synchronize()
        sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def check_compiled_and_graphs(comm, log, transport):
    layer = _layer(comm, "ptpc", transport=transport)
    dev = comm.device
    transport = transport or "auto"  # the CUDA default: the lsa kernel at these sizes

    def block(x):  # torch work on both sides of the op, exact in either form
        return layer(x * 2.0).float() * 0.5

    xs = [_inputs(comm.rank, s)[0].to(dev) * 0.5 for s in (1, 2)]  # the layer sees the inputs themselves
    refs = [tuple(t * 0.5 for t in _budget(comm, layer, s)) for s in (1, 2)]  # and the block halves y
    eager = [block(x) for x in xs]
    compiled = torch.compile(block, fullgraph=True)
    for x, e in zip(xs, eager):
        if not torch.equal(compiled(x), e):
            raise AssertionError(f"{transport}: compiled output differs from eager")
    for e, ref in zip(eager, refs):
        if _bad(e, ref):
            raise AssertionError(f"{transport}: eager block outside the budget")
    log(f"ok {transport}: torch.compile(fullgraph=True) == eager bytes, both within the budget")

    static = xs[0].clone()
    graph, out = captured(lambda: compiled(static), sync=comm.barrier)
    torch.cuda.synchronize()
    comm.barrier()
    for i in range(REPLAYS):
        static.copy_(xs[i % 2])
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(out, eager[i % 2]):
            raise AssertionError(f"{transport}: CUDA graph replay {i} differs from eager")
    log(f"ok {transport}: compiled block captured in a CUDA graph, {REPLAYS} replays with changing inputs == eager")

    overhead = torch.compile(block, fullgraph=True, mode="reduce-overhead")
    for i in range(6):  # warm-up, record, then replays
        got = overhead(xs[i % 2]).clone()
        torch.cuda.synchronize()
        if not torch.equal(got, eager[i % 2]):
            raise AssertionError(f"{transport}: mode='reduce-overhead' call {i} differs from eager")
    log(f"ok {transport}: mode='reduce-overhead' (inductor CUDA graphs), 6 calls == eager")
    layer.close()


def check_backward(comm, log):
    from cco import quant as Q

    layer = _layer(comm, "ptpc", trainable=True)
    x0 = _inputs(comm.rank, 1)[0].to(comm.device)
    grad_y = torch.randn(*LEAD, N, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(comm.device)

    def grads(fn):
        layer.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        fn(x).backward(grad_y)
        return x.grad, layer.weight.grad

    w_used = layer.dequantized_weight(*layer.quantized_weight()).float()
    ref_x = (grad_y.float().reshape(-1, N) @ w_used).reshape(*LEAD, K_RANK)
    ref_w = grad_y.float().reshape(-1, N).t() @ x0.float().reshape(-1, K_RANK)
    # the compiled forward requantizes the master weight in inductor's own kernels: a few e4m3
    # values may round the other way, so compiled and eager are held to the same bound, not bytes
    for name, fn in (("eager", layer), ("compiled", torch.compile(layer, fullgraph=True))):
        gx, gw = grads(fn)
        ex, ew = Q.rel_l2(gx, ref_x), Q.rel_l2(gw, ref_w)
        if not (ex < 1e-2 and ew < 1e-2):
            raise AssertionError(f"{name} gradients off the unfused model's: input {ex:.2e}, weight {ew:.2e}")
        log(f"ok backward {name}: vs unfused rel L2 input {ex:.1e}, weight {ew:.1e}")
    layer.close()


def check_decode(comm, log):
    import torch.distributed as dist

    from cco import quant as Q
    from cco.bench.timing import gemm_mismatches
    from cco.comm import Communicator
    from cco.nn import ColumnParallelLinear, RowParallelLinear
    from kernels_fused.hopper import decode as D
    from kernels_fused.hopper import launch as L

    singles = [dist.new_group([r], backend="gloo") for r in range(comm.world)]  # collective: every rank makes each
    solo = Communicator.from_group(singles[comm.rank], device=comm.device)  # a group of one: the op's plain GEMM
    g = torch.Generator().manual_seed(11 + comm.rank)
    w = (torch.randn(N, K_RANK, generator=g) / K_RANK ** 0.5).to(torch.bfloat16).to(comm.device)
    bias = torch.randn(N, generator=g).to(torch.bfloat16).to(comm.device)
    for quant in Q.QUANTS:
        layers = {"column (local GEMM)": ColumnParallelLinear(K_RANK, N, group=comm, quant=quant, bias=True, m_max=64),
                  "row, one rank": RowParallelLinear(K_RANK, N, group=solo, quant=quant, bias=True, m_max=64)}
        for name, layer in layers.items():
            layer.load_weight(w)
            with torch.no_grad():
                layer.bias.copy_(bias)
            if layer.decode_rows != D.decode_max_m(quant, layer.k_padded):  # blockscale: one row at K 384
                raise AssertionError(f"decode {quant} {name}: decode_rows={layer.decode_rows}, expected "
                                     f"{D.decode_max_m(quant, layer.k_padded)}: {layer!r}")
            layer.decode_rows = max(DECODE_MS)  # the kernel under test, whatever the rule picks per quant
            with torch.no_grad():
                for m in DECODE_MS:
                    x = torch.randn(m, K_RANK, generator=g).to(torch.bfloat16).to(comm.device)
                    with_bias = layer(x)
                    layer.bias.zero_()  # the product alone, against the fp32 product of the quantizer's operands
                    got = layer(x)
                    layer.bias.copy_(bias)
                    if not torch.equal(with_bias, got + bias):
                        raise AssertionError(f"decode {quant} {name} M={m}: the bias is not the layer's out += bias")
                    xq = torch.nn.functional.pad(x.cpu().float(), (0, layer.k_padded - K_RANK))
                    a = Q.dequantize_a(*Q.quantize_a(xq, quant), quant)[:, :K_RANK]
                    wd = layer.dequantized_weight().cpu()
                    bad = gemm_mismatches(got.cpu(), a @ wd.t(), a.abs() @ wd.abs().t())
                    if got.shape != (m, N) or bad:
                        raise AssertionError(f"decode {quant} {name} M={m}: {bad} of {got.numel()} outputs outside "
                                             f"the fp8 GEMM's budget")
                    if not torch.equal(layer(x), with_bias):
                        raise AssertionError(f"decode {quant} {name} M={m}: a repeated call differs")
                    # a model's [B, S, K]: packed (read in place) and strided (rows of a wider tensor)
                    wide = torch.zeros(m, 2 * K_RANK, dtype=x.dtype, device=x.device)
                    wide[:, :K_RANK] = x
                    for shaped in (x.view(1, m, K_RANK), wide[:, :K_RANK].unsqueeze(0)):
                        if not torch.equal(layer(shaped), with_bias.view(1, m, N)):
                            raise AssertionError(f"decode {quant} {name} M={m}: x {list(shaped.shape)} stride "
                                                 f"{shaped.stride()} differs from the rows' call")
                # the kept launches (kernels_fused.hopper.launch) against JITFunction.run's
                for m in (40, 3):  # ptpc's wide MMA, the rows kernels (x, fast: M = 3 for what follows)
                    x = torch.randn(m, K_RANK, generator=g).to(torch.bfloat16).to(comm.device)
                    fast = layer(x)
                    L.FAST_LAUNCH = False
                    slow = layer(x)
                    L.FAST_LAUNCH = True
                    if not torch.equal(fast, slow):
                        raise AssertionError(f"decode {quant} {name} M={m}: the kept launch differs from JITFunction.run")
                # compiled, and captured in a graph replayed on new rows into a NaN-poisoned output
                compiled = torch.compile(lambda v: layer(v), fullgraph=True)
                if not torch.equal(compiled(x), fast):
                    raise AssertionError(f"decode {quant} {name}: compiled differs from eager")
                static_x = x.clone()
                graph, static_out = captured(lambda: layer(static_x))
                for i in range(4):
                    new = torch.randn(3, K_RANK, generator=g).to(torch.bfloat16).to(comm.device)
                    static_x.copy_(new)
                    static_out.fill_(float("nan"))
                    graph.replay()
                    if not torch.equal(static_out, layer(new)):
                        raise AssertionError(f"decode {quant} {name}: graph replay {i} differs from eager")
            log(f"ok decode {quant:10s} {name}: M {DECODE_MS} within the fp8 GEMM's budget; fast launch, compiled, "
                f"graph replays == eager")
            layer.close()
    solo.close()


def check_decode_one_launch(comm, log):
    """ptpc's 2..64 rows in one cooperative launch (``decode_ptpc_kernel``: quantizing phase, grid-wide
    wait, MMA): the eager layer takes it (the stream's wait counter advances once a call) and gives
    the two launches' bytes at every M; and the wait is what makes it right: at 8B down's shape (64
    programs) at 2 rows (fewer quantizing items than programs) with the scratch NaN-poisoned, the
    kernel without the wait (``PHASES=0``) reads rows not yet written in some of its tries, with the
    wait it equals the two launches in every try."""
    from cco import quant as Q
    from cco.nn import ColumnParallelLinear
    from kernels_fused.hopper import decode as D
    from kernels_fused.hopper import decode_kernels as dk
    from kernels_fused.hopper import native as NV
    from scripts.bench_decode import switched_off

    g = torch.Generator().manual_seed(21 + comm.rank)
    w = (torch.randn(N, K_RANK, generator=g) / K_RANK ** 0.5).to(torch.bfloat16).to(comm.device)
    layer = ColumnParallelLinear(K_RANK, N, group=comm, quant="ptpc", bias=False, m_max=64)
    layer.load_weight(w)
    layer.decode_rows = 64
    sync = D._sync(torch.cuda.current_device(), torch.device("cuda", torch.cuda.current_device()))
    NV.ENABLED = False  # the Python path's one launch (its counter); check_decode_native holds the C++ one to it
    try:
        with torch.no_grad():
            for m in [m for m in DECODE_MS if m > 1]:
                x = torch.randn(m, K_RANK, generator=g).to(torch.bfloat16).to(comm.device)
                gen = int(sync[1])
                one = layer(x)
                if int(sync[1]) != gen + 1 or int(sync[0]) != 0:
                    raise AssertionError(f"decode one launch M={m}: the wait counter went {gen} -> {sync.tolist()}: "
                                         f"the call did not take the one launch")
                two = switched_off(lambda: layer(x), D, "ONE_LAUNCH")()
                if int(sync[1]) != gen + 1 or not torch.equal(one, two):
                    raise AssertionError(f"decode one launch M={m}: differs from the two launches")
    finally:
        NV.ENABLED = True
    layer.close()
    # the race: 8B down (N 4096 = 64 programs, K 14336) at 2 rows, the scratch poisoned before each try:
    # 56 quantizing items (28 slices a row), so 8 programs have none and start the MMA at once (at 64
    # rows, one item a program, the tries without the wait were wrong in 1 of 44 on an H200)
    m, n, k = 2, 4096, 14336
    wq, ws = Q.quantize_b(torch.randn(n, k, generator=g) * 0.02, "ptpc")
    wq, ws = wq.to(comm.device), ws.to(comm.device)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(comm.device)
    # the two launches, their MMA split over K as a graph capture runs it: the one launch sums K in the
    # same slices and order (its MMA phase), so the eager call gives the captured call's bits
    want = switched_off(lambda: D.decode_gemm(x, wq, ws, "ptpc", n=n), D, "ONE_LAUNCH")()
    launch = next(lt for key, lt in D._LAUNCHES.items() if key[0] == m and key[1] == k)
    if launch.one is None:
        raise AssertionError(f"decode one launch: 8B down at {m} rows does not take it")
    if launch.kernel.grid[1] < 2:
        raise AssertionError(f"decode one launch: 8B down's MMA is not split over K ({launch.kernel.grid}): this check "
                             f"cannot hold the one launch's sum to the split one")
    sizes, ints, consts = launch.one_args  # (M, N, K, K_PAD), (SLICES, K_SLICE), the constants (PHASES at 6)
    own = torch.zeros(2, dtype=torch.int32, device=comm.device)
    wrong = tries = 0
    while tries < 64 and not (tries >= 8 and wrong):  # the race shows in some tries only (the programs' skew)
        tries += 1
        for phases in (0, 3):
            scratch = torch.full((m * (k + 4),), 0x7F, dtype=torch.uint8, device=comm.device).view(Q.FP8)  # NaN
            out = torch.empty(m, n, dtype=torch.bfloat16, device=comm.device)
            dk.decode_ptpc_kernel[(n // consts[1],)](x, scratch, wq, ws, out, out, own, *sizes, k, Q._TINY, Q.FP8_MAX,
                                                     *ints, *consts[:6], phases, *consts[7:],
                                                     num_warps=D.WIDE_WARPS["ptpc"], num_stages=D.WIDE_STAGES["ptpc"],
                                                     launch_cooperative_grid=True)
            if phases == 3 and not torch.equal(out, want):
                raise AssertionError(f"decode one launch: with the wait, try {tries} differs from the two launches")
            wrong += phases == 0 and not torch.equal(out, want)
    if not wrong:
        raise AssertionError("decode one launch: without the wait all 64 tries were right: this check cannot see a "
                             "missing wait")
    log(f"ok decode one launch (ptpc): M {[m for m in DECODE_MS if m > 1]} == two launches, the wait counted; "
        f"without the wait {wrong} of {tries} tries wrong, with it none")


def check_decode_native(comm, log):
    """The decode GEMM's C++ call path (``kernels_fused.hopper.native``) against the Python path it
    replays, bit for bit: every quant, the one-row, rows and (ptpc) one-launch, two-launch and
    wide-MMA shapes, with and without a bias, [B, S, K] rows, calls under a graph capture (the
    two-launch path, planned at its first capture), and the one launch's wait counted once a call.
    Each compared call is shown to have gone through the table (its count of calls taken)."""
    from cco import quant as Q
    from kernels_fused.hopper import decode as D
    from kernels_fused.hopper import native as NV
    from scripts.bench_decode import switched_off

    if not NV.start(wait=300):
        raise AssertionError(f"decode native: the C++ call path was not built: {NV.error()}")
    table = NV.TABLE
    g = torch.Generator().manual_seed(31 + comm.rank)
    stream = torch.cuda.current_stream().cuda_stream
    cases = 0
    for quant in Q.QUANTS:
        # check_decode's shape (its kernels are compiled); blockscale's rows through cuBLAS at a K it
        # takes, with the weight's padded features copied out and without; mxfp8's there over the
        # weight's bf16 copy (the layers pass it for 2+ rows; one row runs the vendor path too)
        shapes = ((N, K_RANK),) + (((N, 512), (1024, 512)) if quant in D.VENDOR_ROWS else ())
        for n, k in shapes:
            wq, ws = Q.quantize_b(torch.randn(-(-n // 128) * 128, -(-k // 128) * 128, generator=g) * 0.05, quant)
            wq, ws = wq.to(comm.device), ws.to(comm.device)
            if quant == "mxfp8" and k == 512:
                wq = D.vendor.mx_to_bf16(wq, ws)
            bias = torch.randn(n, generator=g).to(torch.bfloat16).to(comm.device)
            for m in DECODE_MS:
                x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(comm.device)
                for b in (None, bias):
                    for one in (True, False):
                        call = lambda: D.decode_gemm(x, wq, ws, quant, n=n, bias=b)  # noqa: E731
                        D.ONE_LAUNCH = one
                        try:
                            want = switched_off(call, NV, "ENABLED")()
                            call()  # plans the shape's launches (the Python path, once)
                            taken = table.taken()
                            sync = table.sync_for(x, stream)
                            gen = int(sync[1])
                            got = call()
                            shaped = D.decode_gemm(x.view(1, m, k), wq, ws, quant, n=n, bias=b)
                        finally:
                            D.ONE_LAUNCH = True
                        where = f"decode native {quant} N={n} K={k} M={m} bias={b is not None} one={one}"
                        if table.taken() != taken + 2:
                            raise AssertionError(f"{where}: the calls did not go through the C++ table "
                                                 f"({table.taken() - taken} of 2)")
                        if not torch.equal(got, want) or not torch.equal(shaped, want.view(1, m, n)):
                            raise AssertionError(f"{where}: differs from the Python path")
                        one_launch = one and 1 < m and quant == "ptpc" and n * wq.shape[1] <= \
                            D.ONE_LAUNCH_MAX_BYTES
                        if int(sync[1]) - gen != (2 if one_launch else 0):
                            raise AssertionError(f"{where}: the wait counter advanced {int(sync[1]) - gen} times "
                                                 f"in two calls")
                        cases += 1
                # graph captures: the two launches (planned by the one=False calls above) through the table
                static_x = x.clone()
                want = switched_off(lambda: switched_off(lambda: D.decode_gemm(static_x, wq, ws, quant, n=n),
                                                         NV, "ENABLED")(), D, "ONE_LAUNCH")()
                for capture in range(2):
                    taken = table.taken()
                    graph, static_out = captured(lambda: D.decode_gemm(static_x, wq, ws, quant, n=n))
                    static_out.fill_(float("nan"))
                    graph.replay()
                    torch.cuda.synchronize()
                    if not torch.equal(static_out, want):
                        raise AssertionError(f"decode native {quant} N={n} K={k} M={m}: capture {capture}'s replay "
                                             f"differs from the Python path's two launches")
                    if table.taken() != taken + 2:
                        raise AssertionError(f"decode native {quant} N={n} K={k} M={m}: capture {capture}'s calls "
                                             f"did not go through the C++ table ({table.taken() - taken} of 2)")
    log(f"ok decode native: {cases} calls == the Python path through the C++ table (every quant, bias or not, "
        f"one launch or two, [B, S, K]), graph captures through it")


def check_decode_split(comm, log):
    """The MMA over quantized rows with K split over programs (``decode.MMA_SPLIT``: a weight of 16
    blocks of 64 features, K 4096, so ptpc splits K in 8 up to 16 rows and in 4 from 32
    (``MMA_SPLIT_WIDE``), blockscale in 8) and one row under a
    capture (the quantizer's launch and the MMA, where eager calls take the one-row kernel): within
    the fp8 GEMM's budget at 1, 8 and 40 rows, eagerly and in graph replays into NaN-poisoned outputs;
    a repeat gives the same bits; and two graphs of one call shape replayed at once on two streams
    give their own products every time (the counters and partials live in each call's scratch, which
    each graph owns: nothing shared)."""
    import torch.distributed as dist

    from cco.bench.timing import gemm_mismatches
    from cco import quant as Q
    from cco.comm import Communicator
    from cco.nn import RowParallelLinear
    from kernels_fused.hopper import decode as D

    singles = [dist.new_group([r], backend="gloo") for r in range(comm.world)]  # collective: every rank makes each
    solo = Communicator.from_group(singles[comm.rank], device=comm.device)
    g = torch.Generator().manual_seed(53 + comm.rank)
    n, k = 1024, 4096
    rows = (1, 8, 40)
    bound, D.CAPTURED_ROW_MIN_BYTES = D.CAPTURED_ROW_MIN_BYTES, 0  # one row's captured MMA at this 4 MB weight
    try:
        for quant in ("ptpc", "blockscale"):
            layer = RowParallelLinear(k, n, group=solo, quant=quant, bias=False, m_max=64)
            layer.load_weight((torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16).to(comm.device))
            wd = layer.dequantized_weight().cpu()
            splits = {m: D.mma_split(quant, n // D.WIDE_BLOCK_N[quant], k // D.WIDE_BLOCK_K[quant], comm.device.index,
                                     D.mma_rows(m)) for m in rows}
            want = {m: (D.MMA_SPLIT_WIDE if D.mma_rows(m) >= D.MMA_SPLIT_WIDE_ROWS else D.MMA_SPLIT)[quant] for m in rows}
            if splits != want:
                raise AssertionError(f"decode split {quant}: the rule gives {splits} slices by rows, {want} expected")

            def budget(x, got, where):
                a = Q.dequantize_a(*Q.quantize_a(x.cpu().float(), quant), quant)
                bad = gemm_mismatches(got.cpu(), a @ wd.t(), a.abs() @ wd.abs().t())
                if bad or got.shape != (x.shape[0], n):
                    raise AssertionError(f"decode split {quant} {where}: {bad} outputs outside the fp8 GEMM's budget")

            with torch.no_grad():
                for m in rows:
                    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(comm.device)
                    eager = layer(x)
                    budget(x, eager, f"M={m} eager")
                    if not torch.equal(layer(x), eager):
                        raise AssertionError(f"decode split {quant} M={m}: a repeated eager call differs")
                    grids = {launch.kernel.grid for key, launch in D._LAUNCHES.items()
                             if key[0] == m and key[-4] == n and launch.quant == quant and launch.kernel is not None}
                    if (n // 64, splits[m]) not in grids:
                        raise AssertionError(f"decode split {quant} M={m}: the MMA's grids {grids}, "
                                             f"({n // 64}, {splits[m]}) expected")
                    statics = [x.clone(), torch.randn(m, k, generator=g).to(torch.bfloat16).to(comm.device)]
                    graphs = [captured(lambda v=v: layer(v)) for v in statics]
                    wants = []
                    for (graph, out), v in zip(graphs, statics):
                        out.fill_(float("nan"))
                        graph.replay()
                        torch.cuda.synchronize()
                        budget(v, out, f"M={m} graph replay")
                        wants.append(out.clone())
                    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
                    for i in range(20):
                        for _, out in graphs:
                            out.fill_(float("nan"))
                        torch.cuda.synchronize()
                        for (graph, _), stream in zip(graphs, streams):
                            with torch.cuda.stream(stream):
                                graph.replay()
                        torch.cuda.synchronize()
                        for (_, out), want in zip(graphs, wants):
                            if not torch.equal(out, want):
                                raise AssertionError(f"decode split {quant} M={m}: two graphs replayed at once on two "
                                                     f"streams, replay {i} differs from the graph's own product")
                    del graphs
            layer.close()
    finally:
        D.CAPTURED_ROW_MIN_BYTES = bound
    solo.close()
    log(f"ok decode split: ptpc K in {D.MMA_SPLIT['ptpc']} ({D.MMA_SPLIT_WIDE['ptpc']} from "
        f"{D.MMA_SPLIT_WIDE_ROWS} rows), blockscale in {D.MMA_SPLIT['blockscale']}, M {rows} "
        f"(one row captured: quantizer + MMA) eager and graph replays within the fp8 budget, repeats equal, two "
        f"graphs of one shape replayed at once on two streams x20 equal to their own products")


def check_decode_vendor(comm, log):
    """blockscale's 2..64 rows in the decode path with ``CCO_DECODE_BLOCKSCALE_CUBLAS=1``'s sets
    (``decode.VENDOR_ROWS``: the activation
    quantizer's launch into rows padded to cuBLAS's multiple of 4, then cuBLAS's blockwise GEMM):
    the layer's decode call equals its general path (``decode_rows = 0``: ``quantize_activation``
    and the op's cuBLAS call) bit for bit at every M, with a bias, first through the Python path and
    then through the C++ table, whose calls run the plan's kept cuBLASLt call (torch's descriptor and
    heuristic pick made once: the same kernel, so the same bits) and, switched off, at::_scaled_mm;
    the rule gives 64 rows where cuBLAS takes the K and one where not. mxfp8's 2..64 rows likewise
    (the quantizer writing the rows dequantized to bf16, and cuBLAS's bf16 GEMM over the bf16 copy of
    the weight that the op holds, one per weight; the table's kept call: cublasGemmEx on torch's
    handle)."""
    import torch.distributed as dist

    from cco.comm import Communicator
    from cco.nn import RowParallelLinear
    from kernels_fused.hopper import decode as D

    singles = [dist.new_group([r], backend="gloo") for r in range(comm.world)]  # collective: every rank makes each
    solo = Communicator.from_group(singles[comm.rank], device=comm.device)
    g = torch.Generator().manual_seed(41 + comm.rank)
    k = 512  # 4 scale blocks: cuBLAS takes it (K_RANK's 384 has 3)
    saved = D.VENDOR_ROWS, D.QUANTIZED_ROWS  # (the layers read the rule at construction: made under it)
    D.VENDOR_ROWS, D.QUANTIZED_ROWS = {"blockscale", "mxfp8"}, {"ptpc"}
    try:
        differed = check_decode_vendor_blockscale(D, RowParallelLinear, solo, g, k, comm.device)
    finally:
        D.VENDOR_ROWS, D.QUANTIZED_ROWS = saved
        D._LAUNCHES.clear()
    ms = [m for m in DECODE_MS if m > 1]
    # mxfp8's rows over the bf16 copy of the weight that the op's vendor GEMM holds (N 1000: its padded
    # features copied out), and over a second weight of the same shape, whose layer shares the op
    # (made with mx_decode off: the copy's path at every M; check_decode_mx covers the kernel's rows)
    D.MX = False
    try:
        mx = [RowParallelLinear(k, N, group=solo, quant="mxfp8", bias=True, m_max=M_MAX) for _ in range(2)]
        big_mx = RowParallelLinear(14336, 4096, group=solo, quant="mxfp8", bias=True, m_max=M_MAX)  # 8B down_proj
    finally:
        D.MX = True
    if mx[0].op is not mx[1].op or mx[0].decode_rows != 64:
        raise AssertionError(f"decode vendor mxfp8: the layers' op shared {mx[0].op is mx[1].op}, decode_rows "
                             f"{mx[0].decode_rows} (64 expected)")
    for each in mx:
        check_vendor_layer(each, ms, g, comm.device, may_differ=False)
    check_vendor_layer(big_mx, (8, 32, 64), g, comm.device, may_differ=False)
    # (the copies held here while compared: a freed one's id could come back for the next)
    dense = [each.op.vendor_weight(*each.quantized_weight()).dense for each in mx for _ in range(2)]
    kept = len(mx[0].op._backend._vendor_weight)
    if dense[0] is not dense[1] or dense[2] is not dense[3] or dense[0] is dense[2] or kept != 2:
        raise AssertionError(f"decode vendor mxfp8: not one bf16 copy per weight (same tensor per layer: "
                             f"{dense[0] is dense[1]}, {dense[2] is dense[3]}; shared: {dense[0] is dense[2]}; "
                             f"the op keeps {kept})")
    for closing in (*mx, big_mx, solo):
        closing.close()
    bound = D.lt_workspace_bytes(torch.cuda.current_device())
    log(f"ok decode vendor (blockscale with CCO_DECODE_BLOCKSCALE_CUBLAS=1's sets): M {ms} at K 512 and M 8, 32, "
        f"64 at 8B down_proj == the layer's general "
        f"path, Python path and C++ table (its kept cuBLASLt call, workspace bound {bound} bytes, torch's bits "
        f"at every shape); at::_scaled_mm with it off; 70B down_proj planned under a 32 MiB bound: shapes whose "
        f"kept call gave other bits and so keep torch's call and bits: {sorted(differed) or 'none'}; mxfp8 M {ms} "
        f"and M 8, 32, 64 at 8B down_proj over the op's bf16 copy (one per weight, two layers sharing the op) == "
        f"the general path, Python and C++ (its kept cublasGemmEx; at::mm with it off or cuBLASLt preferred)")


def check_decode_mx(comm, log):
    """mxfp8's decode rows over the fp8 weight through ``mx_decode``'s CUDA C++ kernel (``decode.MX``):
    the layers' rule (2..16 rows at K_pad < 4096, 2..32 from 4096; more rows read the weight's bf16
    copy, the general path's bits), each kernel call within the fp8 GEMM's budget (a padded N, with
    the bias added as the layer's ``out += bias``), repeats equal, the Python path == the C++ table
    (its calls counted), graph replays == eager into a NaN-poisoned output. A weight with an e8m0
    scale over 134 keeps the copy (the general path's bits); a weight reloaded in place is read by a
    graph captured before; one rewritten in place with a scale over 134 is refused; a call with an
    fp32 bias (the kernel adds bf16 ones) keeps the rows kernel."""
    import torch.distributed as dist

    from cco import quant as Q
    from cco.bench.timing import gemm_mismatches
    from cco.comm import Communicator
    from cco.nn import RowParallelLinear
    from kernels_fused.hopper import decode as D
    from kernels_fused.hopper import mx_decode as X
    from kernels_fused.hopper import native as NV
    from scripts.bench_decode import switched_off

    singles = [dist.new_group([r], backend="gloo") for r in range(comm.world)]  # collective: every rank makes each
    solo = Communicator.from_group(singles[comm.rank], device=comm.device)
    g = torch.Generator().manual_seed(61 + comm.rank)
    dev, cases = comm.device, 0

    def weight(n, k):
        return (torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16).to(dev)

    def rows(m, k):
        return torch.randn(m, k, generator=g).to(torch.bfloat16).to(dev)

    with torch.no_grad():
        # K 512 (N 1000, padded to 1024) and Llama-3-8B's down_proj
        for k, n, ms in ((512, 1000, (2, 3, 16, 17, 32)), (14336, 4096, (2, 8, 32, 33))):
            layer = RowParallelLinear(k, n, group=solo, quant="mxfp8", bias=True, m_max=M_MAX)
            most = 32 if k >= 4096 else 16
            if D.mx_rows_max(layer.k_padded) != most or layer._mx_numel != most * k or layer.decode_rows != 64:
                raise AssertionError(f"decode mx K={k}: rows {D.mx_rows_max(layer.k_padded)} ({most} expected), "
                                     f"decode_rows {layer.decode_rows}")
            layer.load_weight(weight(n, k))
            bias = torch.randn(n, generator=g).to(torch.bfloat16).to(dev)
            wd = layer.dequantized_weight().float()
            for m in ms:
                where = f"decode mx N={n} K={k} M={m}"
                x = rows(m, k)
                layer.bias.zero_()
                plain = layer(x)
                layer.bias.copy_(bias)
                layer.decode_rows = 0
                general = layer(x)
                layer.decode_rows = 64
                python = switched_off(lambda: layer(x), NV, "ENABLED")()
                layer(x)  # plans the shape
                taken = NV.TABLE.taken()
                table, again = layer(x), layer(x)
                took = NV.TABLE.taken() - taken
                mx = any(each.mx and each.ints[:3] == (m, n, k) for each in D._LAUNCHES.values())
                if took != 2 or mx != (m <= most):
                    raise AssertionError(f"{where}: {took} of 2 calls through the C++ table; mx_decode's path "
                                         f"{'taken' if mx else 'not taken'} ({most} rows its rule)")
                if not (torch.equal(python, table) and torch.equal(table, again)):
                    raise AssertionError(f"{where}: the C++ table's call differs from the Python path's "
                                         f"({torch.equal(python, table)}) or a repeat differs")
                if not torch.equal(table, plain + bias):
                    raise AssertionError(f"{where}: the bias is not the layer's out += bias")
                if m > most and not torch.equal(table, general):
                    raise AssertionError(f"{where}: past the kernel's rows the copy's path differs from the general "
                                         f"path")
                a = Q.dequantize_a(*Q.quantize_a(x.cpu().float(), "mxfp8"), "mxfp8").to(dev)
                bad = gemm_mismatches(plain, a @ wd.t(), a.abs() @ wd.abs().t())
                if plain.shape != (m, n) or bad:
                    raise AssertionError(f"{where}: {bad} of {plain.numel()} outputs outside the fp8 GEMM's budget")
                static_x = x.clone()
                graph, static_out = captured(lambda: layer(static_x))
                new = rows(m, k)
                static_x.copy_(new)
                static_out.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                if not torch.equal(static_out, layer(new)):
                    raise AssertionError(f"{where}: a graph replay differs from eager")
                cases += 1
            layer.close()
        # an fp32 bias (the kernel adds bf16 ones): decode_gemm keeps such calls on the rows kernel
        k, n = 512, 1024
        wq, ws = (t.to(dev) for t in Q.quantize_b(torch.randn(n, k, generator=g) / k ** 0.5, "mxfp8"))
        wide_bias, x = torch.randn(n, generator=g).to(dev), rows(8, k)
        got = D.decode_gemm(x, wq, ws, "mxfp8", n=n, bias=wide_bias, scales_checked=True)
        if not torch.equal(got, D.decode_gemm(x, wq, ws, "mxfp8", n=n, bias=wide_bias)) or any(
                each.mx and each.ints[:3] == (8, n, k) for each in D._LAUNCHES.values()):
            raise AssertionError("decode mx: a call with an fp32 bias took mx_decode")
        # a scale over 134: the weight's rows read the copy (the general path's bits)
        wq, ws = Q.quantize_b(torch.randn(n, k, generator=g) / k ** 0.5, "mxfp8")
        big = ws.view(torch.uint8).clone()
        big[5, 3] = X.MAX_SCALE + 1
        big = big.view(ws.dtype)
        layer = RowParallelLinear(k, n, group=solo, quant="mxfp8", bias=True, m_max=M_MAX)
        layer.load_fp8(wq, big)
        why = X.unsuited(*layer.quantized_weight())
        x = rows(8, k)
        layer.decode_rows = 0
        general = layer(x)
        layer.decode_rows = 64
        if why is None or str(X.MAX_SCALE) not in why or not torch.equal(layer(x), general):
            raise AssertionError(f"decode mx, a scale over {X.MAX_SCALE}: unsuited says {why!r}; equal to the general "
                                 f"path {torch.equal(layer(x), general)}")
        # the weight reloaded in place under a graph captured before; then rewritten with that scale
        layer.load_fp8(wq, ws)
        first = layer(x)
        graph, static_out = captured(lambda: layer(x))
        layer.load_weight(weight(n, k))
        want = layer(x)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if torch.equal(want, first) or not torch.equal(static_out, want):
            raise AssertionError("decode mx: after a reload in place the replay differs from the eager call")
        layer.load_fp8(wq, big)
        try:
            layer(x)
        except RuntimeError as err:
            if "CCO_DECODE_MX=0" not in str(err):
                raise
        else:
            raise AssertionError(f"decode mx: a weight rewritten in place with a scale over {X.MAX_SCALE} was taken")
        layer.close()
    solo.close()
    log(f"ok decode mx: {cases} layer calls (K 512 and 14336, 2..33 rows): mx_decode up to its rule's rows within the "
        f"fp8 budget, the bias as out += bias, the copy's path past them == the general path, Python == C++ table, "
        f"repeats and graph replays == eager; a scale over {X.MAX_SCALE} keeps the copy; a reload in place replays the "
        f"new weight; a rewrite with such a scale is refused; an fp32 bias keeps the rows kernel")


def check_decode_vendor_blockscale(D, RowParallelLinear, solo, g, k, device):
    """check_decode_vendor's blockscale layers (made and checked under the cuBLAS rule's sets); returns
    the 70B shapes whose kept call differed under a 32 MiB bound."""
    layer = RowParallelLinear(k, N, group=solo, quant="blockscale", bias=True, m_max=M_MAX)
    narrow = RowParallelLinear(K_RANK, N, group=solo, quant="blockscale", m_max=M_MAX)
    if (layer.decode_rows, narrow.decode_rows) != (64, 1):
        raise AssertionError(f"decode vendor: decode_rows {layer.decode_rows} at K {k} (64 expected), "
                             f"{narrow.decode_rows} at K {narrow.k_padded} (1 expected)")
    ms = [m for m in DECODE_MS if m > 1]
    # and Llama-3-8B's down_proj at 8, 32 and 64 rows, where a kept call asked with 32 MiB of workspace
    # picked another kernel than torch's 1 MiB at 32 and 64 rows (docs/decode.md): with the rule's bound
    # none may differ
    big = RowParallelLinear(14336, 4096, group=solo, quant="blockscale", bias=True, m_max=M_MAX)
    for each, rows in ((layer, ms), (big, (8, 32, 64))):
        check_vendor_layer(each, rows, g, device, may_differ=False)
    # the guard (decode._same_bits) on a plan asked with another bound than torch's, 32 MiB, at
    # Llama-3-70B's down_proj: a shape whose kept call gives other bits keeps torch's call and its bits
    wide = RowParallelLinear(28672, 8192, group=solo, quant="blockscale", bias=True, m_max=M_MAX)
    rule = D.lt_workspace_bytes
    D.lt_workspace_bytes = lambda device: 32 << 20
    try:
        differed = check_vendor_layer(wide, (8, 32, 64), g, device, may_differ=True)
    finally:
        D.lt_workspace_bytes = rule
    for closing in (layer, narrow, big, wide):
        closing.close()
    return differed


def check_mxfp8_copy_under_graphs(comm, log):
    """mxfp8's bf16 copy of the weight (the op's vendor GEMM's, which the decode rows read too) under
    CUDA graphs: a graph captured after an eager call reads the kept copy; after the weight is
    written in place (``load_weight``) and one eager call, the copy is the same tensor brought up
    to date, so a replay gives the new weight's output, for the decode rows past mx_decode's (24 at
    K 512) and the vendor GEMM's rows (128); and at 8 rows, which mx_decode takes over the fp8 weight
    itself. Replacing the copy instead would free it under the graph (the replay then reads freed
    memory) and keeping it unchanged would replay the old weight."""
    import torch.distributed as dist

    from cco.comm import Communicator
    from cco.nn import RowParallelLinear

    singles = [dist.new_group([r], backend="gloo") for r in range(comm.world)]
    solo = Communicator.from_group(singles[comm.rank], device=comm.device)
    g = torch.Generator().manual_seed(53 + comm.rank)
    n, k = 1000, 512
    layer = RowParallelLinear(k, n, group=solo, quant="mxfp8", bias=True, m_max=256)
    layer.load_weight((torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16).to(comm.device))
    with torch.no_grad():
        layer.bias.copy_(torch.randn(n, generator=g).to(torch.bfloat16))
        for m in (8, 24, 128):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(comm.device)
            layer(x)  # eager: the copy made and kept
            copy = layer.op.vendor_weight(*layer.quantized_weight()).dense
            graph, static = captured(lambda: layer(x))
            layer.load_weight((torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16).to(comm.device))
            want = layer(x)  # eager: the copy brought up to date in place
            static.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            now = layer.op.vendor_weight(*layer.quantized_weight()).dense
            if now is not copy:
                raise AssertionError(f"mxfp8 copy under graphs M={m}: the reloaded weight's copy is a new tensor")
            if not torch.equal(static, want):
                raise AssertionError(f"mxfp8 copy under graphs M={m}: the replay after a reload differs from the "
                                     f"eager call ({int((static != want).sum())} elements)")
    layer.close()
    solo.close()
    log("ok mxfp8 copy under graphs: M 8 (mx_decode), 24 (decode rows) and 128 (vendor GEMM): a weight reloaded in "
        "place, one eager "
        "call, then the graph captured before replays the new weight (the same copy, brought up to date)")


def check_preshuffled_copy_under_graphs(comm, log):
    """An op built with ``weight_layout="bpreshuffle"`` (the op's default) reads a row-major copy of
    the weight on NVIDIA (``CudaBackend._unshuffled``). Under CUDA graphs: a graph captured after an
    eager call reads that copy; an eager call with another weight must not free it (the replay
    still gives the captured weight's product, with the freed bytes overwritten), and after the
    weight is written in place and one eager call, the copy is the same tensor brought up to date,
    so a replay gives the new weight's product. ptpc and blockscale, at 8 rows (the own kernel) and
    256 (the vendor GEMM)."""
    import torch.distributed as dist

    from cco import GemmAllReduceOp
    from cco import quant as Q
    from cco.comm import Communicator
    from cco.preshuffle import preshuffle_b

    singles = [dist.new_group([r], backend="gloo") for r in range(comm.world)]
    solo = Communicator.from_group(singles[comm.rank], device=comm.device)
    g = torch.Generator().manual_seed(71 + comm.rank)
    n, k, dev = 1024, 512, comm.device

    def weight(quant):
        q, scale = Q.quantize_b(torch.randn(n, k, generator=g) / k ** 0.5, quant)
        return preshuffle_b(q).to(dev), scale.to(dev)

    for quant in ("ptpc", "blockscale"):
        with GemmAllReduceOp(solo, n=n, k=k, m_max=256, quant=quant, weight_layout="bpreshuffle") as op:
            for m in (8, 256):
                b_pre, b_scale = weight(quant)
                a, a_scale = (t.to(dev) for t in Q.quantize_a(torch.randn(m, k, generator=g), quant))
                op(a, b_pre, a_scale, b_scale)  # eager: the copy made and kept
                copy = op._backend._unshuffled(b_pre)
                graph, static = captured(lambda: op(a, b_pre, a_scale, b_scale))
                first = op(a, b_pre, a_scale, b_scale).clone()
                other = weight(quant)
                op(a, other[0], a_scale, other[1])  # another weight, eagerly: the captured copy must outlive it
                junk = [torch.full((n, k), 0x7F, dtype=torch.uint8, device=dev) for _ in range(4)]
                static.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                del junk
                if not torch.equal(static, first):
                    raise AssertionError(f"preshuffled copy under graphs {quant} M={m}: after another weight's call "
                                         f"the replay differs ({int((static != first).sum())} elements)")
                new_q, new_s = weight(quant)
                b_pre.copy_(new_q)
                b_scale.copy_(new_s)
                want = op(a, b_pre, a_scale, b_scale)  # eager: the copy brought up to date in place
                static.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                if op._backend._unshuffled(b_pre) is not copy:
                    raise AssertionError(f"preshuffled copy under graphs {quant} M={m}: the rewritten weight's copy "
                                         f"is a new tensor")
                if not torch.equal(static, want) or torch.equal(want, first):
                    raise AssertionError(f"preshuffled copy under graphs {quant} M={m}: the replay after the weight "
                                         f"was written differs from the eager call "
                                         f"({int((static != want).sum())} elements)")
    solo.close()
    log("ok preshuffled copy under graphs: ptpc and blockscale, M 8 and 256: another weight's call leaves the "
        "captured copy alive; a weight written in place, one eager call, then the replay gives the new weight")


def check_vendor_layer(layer, ms, g, device, may_differ):
    """check_decode_vendor's comparisons for one layer at each M of ``ms``; returns the call shapes
    whose kept call gave other bits than torch's at their first call (``decode.KEPT_DIFFERED``: they
    keep torch's call, and must still give its bits), which only ``may_differ`` allows. The kept call:
    blockscale's cuBLASLt call, mxfp8's cublasGemmEx on torch's handle (its rows: the bf16 GEMM over
    the weight's copy); mxfp8's is also shown to step aside where torch's mm would not call it (the
    cuBLASLt library preferred)."""
    from kernels_fused.hopper import decode as D, native as NV
    from scripts.bench_decode import switched_off

    n, k = layer.out_features, layer.in_features_per_rank
    where = f"decode vendor {layer.quant} N={n} K={k}"
    layer.load_weight((torch.randn(n, k, generator=g) / k ** 0.5).to(torch.bfloat16).to(device))
    with torch.no_grad():
        layer.bias.copy_(torch.randn(n, generator=g).to(torch.bfloat16))
        for m in ms:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(device)
            layer.decode_rows = 0
            want = layer(x)
            layer.decode_rows = 64
            python = switched_off(lambda: layer(x), NV, "ENABLED")()  # (with the table off nothing is planned)
            layer(x)  # plans the shape where it is new (and compares the kept call's bits with torch's)
            shape = (m, layer.k_padded, n)
            if shape in D.KEPT_DIFFERED and not may_differ:
                raise AssertionError(f"{where} M={m}: the kept call gave other bits than torch's")
            taken, kept = NV.TABLE.taken(), NV.TABLE.kept_taken()
            table = layer(x)
            if NV.TABLE.taken() != taken + 1:
                raise AssertionError(f"{where} M={m}: the call did not go through the C++ table")
            if NV.TABLE.kept_taken() != kept + (shape not in D.KEPT_DIFFERED):  # the kept call, not torch's op
                raise AssertionError(f"{where} M={m}: the table's call did not run its kept call "
                                     f"({NV.TABLE.kept_error() or 'no error recorded'})")
            if not torch.equal(python, want) or not torch.equal(table, want):
                raise AssertionError(f"{where} M={m}: the decode path differs from the layer's general path "
                                     f"(Python path equal: {torch.equal(python, want)})")
        # the kept call switched off (CCO_DECODE_KEPT_CALL=0): the table's torch op, the same bits
        taken, kept = NV.TABLE.taken(), NV.TABLE.kept_taken()
        table = switched_off(lambda: layer(x), D, "KEPT_CALL")()
        if (NV.TABLE.taken(), NV.TABLE.kept_taken()) != (taken + 1, kept) or not torch.equal(table, want):
            raise AssertionError(f"{where} M={m}, kept call off: taken {NV.TABLE.taken() - taken}, kept calls "
                                 f"{NV.TABLE.kept_taken() - kept} (1 and 0 expected), equal {torch.equal(table, want)}")
        if layer.quant == "mxfp8":  # torch's mm on cuBLASLt: the table calls at::mm, torch's bits again
            preferred = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library("cublaslt")
            try:
                layer.decode_rows = 0
                want = layer(x)
                layer.decode_rows = 64
                taken, kept = NV.TABLE.taken(), NV.TABLE.kept_taken()
                table = layer(x)
            finally:
                torch.backends.cuda.preferred_blas_library(preferred)
            if (NV.TABLE.taken(), NV.TABLE.kept_taken()) != (taken + 1, kept) or not torch.equal(table, want):
                raise AssertionError(f"{where} M={m}, cuBLASLt preferred: taken {NV.TABLE.taken() - taken}, kept "
                                     f"calls {NV.TABLE.kept_taken() - kept} (1 and 0 expected), equal "
                                     f"{torch.equal(table, want)}")
    return {shape for shape in D.KEPT_DIFFERED if shape[1:] == (layer.k_padded, n) and shape[0] in ms}


def rank_main():
    from cco.comm import Communicator
    from cco.window import ranks_share_a_device

    comm = Communicator.from_env()
    log = (lambda *a: print(*a, flush=True)) if comm.rank == 0 else (lambda *a: None)
    log("the ranks share one GPU (IPC window)" if ranks_share_a_device(comm) else "one GPU per rank")
    from kernels_fused.hopper import native
    # the decode checks below run through the C++ call path where it builds (check_decode_native
    # fails where it does not), not through whichever path a background build reached by then
    start = time.monotonic()
    log(f"decode C++ call path: {'loaded' if native.start(wait=300) else native.error()} "
        f"({time.monotonic() - start:.0f} s)")
    checks = [lambda: check_quantizer(comm, log), lambda: check_layers(comm, log),
              lambda: check_compiled_and_graphs(comm, log, None), lambda: check_compiled_and_graphs(comm, log, "dma"),
              lambda: check_backward(comm, log), lambda: check_decode(comm, log),
              lambda: check_decode_one_launch(comm, log), lambda: check_decode_native(comm, log),
              lambda: check_decode_split(comm, log), lambda: check_decode_vendor(comm, log), lambda: check_mxfp8_copy_under_graphs(comm, log),
              lambda: check_decode_mx(comm, log),
              lambda: check_preshuffled_copy_under_graphs(comm, log), lambda: check_local_failure(comm, log),
              lambda: check_wrong_device(comm, log),
              lambda: check_layers_called_apart(comm, log), lambda: check_calls_across_the_seq_wrap(comm, log)]
    failures = []
    for check in checks:  # keep going so one run reports every failing check
        try:
            check()
        except Exception as err:
            failures.append(f"{type(err).__name__}: {err}")
            log("FAIL", failures[-1])
        torch.cuda.synchronize()
        comm.barrier()
    if failures:
        raise SystemExit("CUDA_NN_CHECKS FAILED:\n" + "\n".join(failures))
    log("CUDA_NN_CHECKS PASSED")
    comm.close()


if __name__ == "__main__":
    rank_main()
