"""The blockscale GEMM in Gluon (``kernels_fused.hopper.gluon_gemm``: each K step's MMA kept in flight
while the previous product is scaled) against cuBLAS's blockwise GEMM and the own Triton kernel, at
the reduce-scatter producers' shapes, device time under graph replay, one GPU::

    python3 -m scripts.probe_gluon_blockscale -m 4096,16384 gluon.json
    python3 -m scripts.probe_gluon_blockscale --decode 8b-o-tp1,8b-down-tp1 --rows 8,32,64 decode.json
    python3 -m scripts.probe_gluon_blockscale --compile-only     # the host, no GPU

Why: the own blockscale kernel waits for each K step's MMA before issuing the next (Triton scales
the product before adding it), ~1.5x of cuBLAS (docs/hopper_gemm.md); Gluon lets the kernel wait
for all but the last MMA instead. Whether that is time, and whether it closes the gap to cuBLAS, is
what this measures.

Shapes: the row-parallel down projection of Llama-3-70B and DeepSeek-V3's dense MLP
(``scripts.bench_sp_parts.layer_shape``, pattern ``rs-rows``) at each TP: N = hidden, K =
intermediate / TP; M the tokens. Arms per (shape, M): ``cuBLAS`` (where ``vendor.takes_rows``
trusts it), ``own grid 64x128`` (the tile-table kernel's blockscale tile), and ``gluon 128x128``
at each ``--stages``. Every arm is first checked against the fp32 product of the dequantized
operands on sampled rows (``gemm_mismatches``); a wrong arm posts no time. Timing:
``bench_decode.graph_timings`` (a graph of 3 calls, the arms alternating per pass). One line per
(shape, M): each arm's median us and its ratio to cuBLAS (else to the own kernel), pass by pass
(median and range; lower is better).

``--decode SHAPES --rows ROWS``: the decode MMA over quantized rows instead
(``decode_blockscale_mma_kernel``, the same overlap), at ``scripts.tune_decode.SHAPES``: arms
``nn.Linear bf16``, ``decode_gemm`` (the layer's rule: the quantizer's launch and the Triton MMA,
as a capture takes them) and ``quantizer + gluon split S`` (the same quantizer, then the Gluon MMA
with K in S slices), each checked as above and for equal bits on a repeat; graphs of 10 calls; one
line per (shape, M) with each arm's us and its ratio to ``nn.Linear`` (lower is better).

``--compile-only [JSON]``: compile the kernels for sm_90 with the installed Triton (no GPU) and print
their registers, spills, shared memory and the K loop's MMA waits (with JSON, write the reports
there too, PTX included: ``test_gluon_gemm.py`` reads them); exit 1 where one does not compile,
spills, needs more than a Hopper SM's shared memory, or waits for every MMA (no ``wgmma.wait_group
1``: the overlap this kernel exists for).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

HOPPER_SHARED = 227 * 1024  # the most dynamic shared memory one block may take on sm_90
GRAPH_CALLS = 3


def parse_args(argv=None):
    from scripts.bench_sp_parts import MODELS, _list

    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()).replace("``", ""))
    p.add_argument("--model", type=_list(str, MODELS), default=list(MODELS), help="comma list of models")
    p.add_argument("--tp", type=_list(int, (2, 4, 8)), default=[4, 8], help="comma list of TP degrees")
    p.add_argument("-m", type=_list(int, None), default=[4096, 16384], help="comma list of token counts M")
    p.add_argument("--stages", type=_list(int, None), default=[3, 4], help="comma list of the Gluon ring's stages")
    p.add_argument("--passes", type=int, default=5)
    p.add_argument("--decode", type=_list(str, None), default=None,
                   help="comma list of decode shapes (scripts.tune_decode.SHAPES): time the decode MMA instead")
    p.add_argument("--rows", type=_list(int, None), default=[8, 32, 64], help="decode: comma list of rows M (2..64)")
    p.add_argument("--compile-only", action="store_true", help="compile for sm_90 on the host and check it")
    p.add_argument("json", nargs="?", help="write the rows here (after every shape; --compile-only: the reports)")
    args = p.parse_args(argv)
    if args.compile_only:
        return args
    if args.json is None:
        p.error("json: the file to write the rows to is required (or pass --compile-only)")
    where = os.path.dirname(args.json)
    if where and not os.path.isdir(where):
        p.error(f"json {args.json}: directory {where} does not exist")
    if any(m < 1 for m in args.m) or args.passes < 1 or any(s < 2 for s in args.stages):
        p.error("M and --passes must be >= 1, --stages >= 2")
    if args.decode is not None:
        from scripts.tune_decode import SHAPES

        unknown = [name for name in args.decode if name not in SHAPES]
        if unknown:
            p.error(f"--decode {','.join(unknown)}: not a shape of scripts.tune_decode ({', '.join(SHAPES)})")
        if any(not 2 <= m <= 64 for m in args.rows):
            p.error("--rows: the decode MMA takes 2..64 rows")
    return args


def compile_for_sm90(kernel: str = "gemm", *, stages: int = 4, rows: int = 64, split: int = 4,
                     loads_only: bool = False) -> dict:
    """A kernel of ``kernels_fused.hopper.gluon_gemm`` compiled for sm_90 by the installed Triton, on the
    host: its PTX and the cubin's registers, spills (local memory) and shared memory (``cuobjdump``
    from Triton's own bundle). ``kernel``: "gemm" (the 128x128 GEMM, 8 warps), "pingpong" (ptpc's
    ping-pong GEMM of ``kernels_fused.hopper.gluon_pingpong``: 4 warps a partition, 12 in all) or
    "decode" (the MMA over ``rows`` quantized rows, 4 warps, K in ``split`` slices). ``loads_only``:
    the ping-pong's measurement of its ring alone (``LOADS_ONLY``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from kernels_fused.hopper import gluon_gemm

    def desc(block, dtype=torch.float8_e4m3fn, gl_dtype=gl.float8e4nv):  # (its type: the block and layout)
        return mangle_type(gluon_gemm.descriptor(torch.empty(256, 256, dtype=dtype), block, gl_dtype))
    options = {}
    # the two GEMMs' operands: 128x128 tiles of e4m3 A and B and of the bf16 output, and the scales
    gemm_operands = {"a_desc": desc([128, 128]), "b_desc": desc([128, 128]),
                     "c_desc": desc([128, 128], torch.bfloat16, gl.bfloat16), "as_ptr": "*fp32", "bs_ptr": "*fp32",
                     **dict.fromkeys(("M", "N", "K"), "i32")}
    if kernel == "gemm":
        fn, num_warps = gluon_gemm.fp8_blockscale_gemm_kernel, 8
        signature = {**gemm_operands, **dict.fromkeys(("stride_asm", "stride_ask", "stride_bsn", "stride_bsk"), "i32")}
        constexprs = {"GROUP_M": 8, "STAGES": stages, "num_warps": num_warps}
    elif kernel == "pingpong":  # ptpc's ping-pong GEMM (kernels_fused.hopper.gluon_pingpong), 12 warps in all
        from kernels_fused.hopper import gluon_pingpong

        fn, num_warps = gluon_pingpong.fp8_ptpc_pingpong_kernel, 4
        options["maxnreg"] = gluon_pingpong.MAXNREG
        signature = gemm_operands
        constexprs = {"STAGES": stages, "num_warps": num_warps, "LOADS_ONLY": loads_only}
    elif kernel == "decode":
        fn, num_warps = gluon_gemm.decode_blockscale_mma_kernel, 4
        signature = {"w_desc": desc([64, 128]), "q_desc": desc([rows, 128]), "sa_ptr": "*fp32", "ws_ptr": "*fp32",
                     "bias_ptr": "*bf16", "out_ptr": "*bf16", "cnt_ptr": "*i32", "part_ptr": "*fp32",
                     **dict.fromkeys(("M", "N", "K_PAD", "K_SLICE", "stride_sa", "stride_ws"), "i32")}
        constexprs = {"HAS_BIAS": False, "SPLIT": split, "STAGES": stages, "num_warps": num_warps}
    else:
        raise ValueError(f"compile_for_sm90: kernel={kernel!r}; pass 'gemm', 'pingpong' or 'decode'")
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    source = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, **options})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    local = int(re.search(r"LOCAL:(\d+)", usage).group(1))
    return {"kernel": kernel, "triton": triton.__version__, "stages": stages, "num_warps": num_warps,
            "registers": regs, "local_bytes": local, "shared_bytes": compiled.metadata.shared,
            "ptx": compiled.asm["ptx"]}


def loop_waits(ptx: str) -> dict:
    """The PTX's MMA waits by how many MMA groups they leave in flight (``{1: count, 0: count}``)."""
    waits = re.findall(r"wgmma\.wait_group\.sync\.aligned (\d+);", ptx)
    return {int(w): waits.count(w) for w in sorted(set(waits))}


def compile_problems(report: dict) -> list[str]:
    """Why the compiled kernel fails the host's check (empty: it passes)."""
    problems = []
    if report["local_bytes"]:
        problems.append(f"{report['local_bytes']} bytes of local memory a thread (spills)")
    if report["shared_bytes"] > HOPPER_SHARED:
        problems.append(f"{report['shared_bytes']} bytes of shared memory, more than sm_90's {HOPPER_SHARED}")
    if loop_waits(report["ptx"]).get(1, 0) < 1:
        problems.append("no wgmma.wait_group 1: every MMA is waited for before the next")
    if report["kernel"] == "pingpong":
        problems += pingpong_problems(report["ptx"])
    return problems


def pingpong_problems(ptx: str) -> list[str]:
    """Why the ping-pong GEMM's PTX is not what it exists for (empty: it is): its partitions' registers
    moved (``setmaxnreg``: the consumers up, the loader down; else the compiler did not split the
    kernel), and a barrier of the issuing warpgroup after every wait for a TMA store's reads (the
    wait is the issuing thread's; a staging tile written again before the store read it is a race)."""
    problems = []
    moved = set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);", ptx))
    if ("inc", "232") not in moved or ("dec", "40") not in moved:
        problems.append(f"the partitions' registers not moved to 232 / 40 (setmaxnreg: {sorted(moved)})")
    lines = [ln.strip() for ln in ptx.splitlines() if ln.strip()]
    waits = [i for i, ln in enumerate(lines) if ln.startswith("cp.async.bulk.wait_group.read")]
    for i in waits:  # the first barrier or shared store after the wait must be the barrier
        first = next((ln for ln in lines[i + 1:] if re.match(r"(bar|barrier)\.sync|st\.shared|stmatrix", ln)), "")
        if not re.match(r"(bar|barrier)\.sync", first):
            problems.append(f"PTX line {i}: a TMA store's wait followed by {first or 'nothing'!r} before any barrier")
    if len(waits) < 2:
        problems.append(f"{len(waits)} waits for a TMA store's reads: each consumer waits before it writes its staging")
    return problems


def arms_of(p, stages: list[int]) -> dict:
    """Label -> a call writing its own fresh ``out`` (each arm's, so the graphs do not share it)."""
    from kernels_fused.hopper import gluon_gemm, vendor
    from kernels_fused.hopper.gemm import GemmConfig, fp8_gemm

    m, n, k = p.a.shape[0], p.b.shape[0], p.a.shape[1]
    arms = {}

    def fresh():
        return torch.empty(m, n, dtype=torch.bfloat16, device=p.a.device)
    if vendor.takes_rows("blockscale", m, k):  # (the weight prepared once, as the backends keep it)
        weight = vendor.prepare_weight(p.b, p.b_scale, "blockscale")
        arms["cuBLAS"] = lambda o=fresh(): vendor.vendor_gemm(p.a, p.a_scale, weight, out=o)
    own = GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=3)
    arms["own grid 64x128"] = lambda o=fresh(): fp8_gemm(p.a, p.b, p.a_scale, p.b_scale, quant="blockscale", out=o,
                                                         config=own, validated=True)
    for s in stages:
        arms[f"gluon 128x128 {s} stages"] = (
            lambda o=fresh(), s=s: gluon_gemm.blockscale_gemm(p.a, p.b, p.a_scale, p.b_scale, out=o, stages=s))
    return arms


def check(arms: dict, p, quant: str = "blockscale") -> dict:
    """Label -> why the arm is wrong (absent: right): sampled rows against the fp32 product."""
    from cco import quant as Q
    from cco.bench.timing import gemm_mismatches
    from scripts.bench_sp_parts import check_rows

    idx = check_rows(p.a.shape[0]).to(p.a.device)
    a = Q.dequantize_a(p.a, p.a_scale, quant)[idx]
    b = Q.dequantize_b(p.b, p.b_scale, quant)
    ref, dot_abs = a @ b.t(), a.abs() @ b.abs().t()
    wrong = {}
    for label, fn in arms.items():
        try:
            out = fn()
        except Exception as err:  # noqa: BLE001 - a launch that fails is reported, the others still run
            wrong[label] = f"raised {type(err).__name__}: {err}"
            continue
        bad = gemm_mismatches(out[idx], ref, dot_abs)
        if bad:
            wrong[label] = f"{bad} elements outside the budget"
    return wrong


# what --compile-only builds: the GEMM at both ring depths, and the decode MMA at the narrowest rows unsplit
# and the widest split
COMPILED = (("gemm", dict(stages=3)), ("gemm", dict(stages=4)), ("decode", dict(rows=16, split=1)),
            ("decode", dict(rows=64, split=4)), ("pingpong", dict(stages=3)), ("pingpong", dict(stages=4)))


def compile_only(json_path: str | None = None) -> int:
    """Compile every ``COMPILED`` case, print each one's budget and waits; with ``json_path``, write the
    reports there too (``{"reports": [...]}``, in ``COMPILED``'s order, PTX included)."""
    failed, reports = 0, []
    for kernel, options in COMPILED:
        report = compile_for_sm90(kernel, **options)
        reports.append(dict(report, options=options))
        problems = compile_problems(report)
        print(f"gluon {kernel} {options} {report['num_warps']} warps, Triton {report['triton']}, sm_90: "
              f"{report['registers']} registers, {report['local_bytes']} bytes local, {report['shared_bytes']} "
              f"bytes shared; MMA waits by groups left in flight {loop_waits(report['ptx'])}")
        for why in problems:
            print(f"FAIL: {why}")
        failed += bool(problems)
    if json_path is not None:
        with open(json_path, "w") as f:
            json.dump({"reports": reports}, f)
    return 1 if failed else 0


DECODE_SPLITS = (1, 2, 4, 8)  # the Gluon decode MMA's K slices timed (the rule's Triton MMA: 4 at 8B o and down)


def decode_rows_table(args, command: str) -> int:
    """``--decode``: one row per (shape, M) into ``args.json``; returns the number of wrong cells."""
    from cco import quant as Q
    from kernels_fused.hopper import decode as D
    from kernels_fused.hopper import gluon_gemm
    from kernels_fused.hopper import native as NV
    from kernels_fused.hopper.quantize import quantize_activation
    from scripts.tune_decode import checked_arms, graph_us, shape_weight

    NV.ENABLED = False  # the Python path's launches, as a graph captures them
    dev = torch.device("cuda")
    rows, failed, t0 = [], 0, time.time()
    for name in args.decode:
        n, k, w, w_bf16 = shape_weight(name, dev)
        wq, ws = Q.quantize_b(w, "blockscale")
        wd = Q.dequantize_b(wq, ws, "blockscale")
        for m in args.rows:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            q, sa = quantize_activation(x, "blockscale", k_padded=k)
            ad = Q.dequantize_a(q, sa, "blockscale")
            ref, dot_abs = ad @ wd.t(), ad.abs() @ wd.abs().t()
            arms = {"nn.Linear bf16": lambda x=x: torch.nn.functional.linear(x, w_bf16),
                    "decode_gemm": lambda x=x: D.decode_gemm(x, wq, ws, "blockscale", n=n)}
            for split in DECODE_SPLITS:  # (each arm's own scratch and output, made once: none inside its graph)
                scratch = dict(gluon_gemm.decode_scratch(m, n, split, dev),
                               out=torch.empty(m, n, dtype=torch.bfloat16, device=dev))
                arms[f"quantizer + gluon split {split}"] = (
                    lambda x=x, split=split, scratch=scratch: gluon_gemm.decode_blockscale_mma(
                        *quantize_activation(x, "blockscale", k_padded=k), wq, ws, n, split=split, **scratch))
            outs, bad, wrong, errors = checked_arms(arms, ref, dot_abs, f"{name} M={m}")
            failed += bool(wrong or errors)
            same_bits = {label: bool(torch.equal(outs[label], outs["decode_gemm"])) for label in outs
                         if label.startswith("quantizer + gluon") and "decode_gemm" in outs}
            t = graph_us(arms, 10, args.passes)
            base = t["nn.Linear bf16"]
            print(f"[{time.time() - t0:.0f} s] {name} M={m}: " + " | ".join(
                f"{a} {v:.1f} ({v / base:.2f}x)" for a, v in t.items()), flush=True)
            rows.append({"shape": name, "n": n, "k": k, "m": m, "us": t, "outside_budget": bad, "wrong": wrong,
                         "errors": errors, "bits_equal_decode_gemm": same_bits})
            with open(args.json, "w") as f:
                json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": command,
                           "note": "device us per call, graphs of 10 calls, median over passes; lower is better",
                           "rows": rows}, f, indent=1)
    return failed


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compile_only:
        return compile_only(args.json)
    from cco.bench.timing import require_cuda

    require_cuda("probe_gluon_blockscale")
    command = "python3 -m scripts.probe_gluon_blockscale " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.decode is not None:
        return 1 if decode_rows_table(args, command) else 0
    return 1 if gemm_table(args, command, "blockscale", lambda p: arms_of(p, args.stages)) else 0


def kernel_names(fn) -> list[str]:
    """The names of the CUDA kernels one call of ``fn`` launches (torch's profiler), in order."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def gemm_table(args, command: str, quant: str, make_arms, checks=(), unchecked: str | None = None,
               patterns=("rs-rows", )) -> int:
    """One row per (pattern, model, TP, M) of ``args`` at each pattern's GEMM shapes
    (``bench_sp_parts.layer_shape``: the reduce-scatter producers' by default) into ``args.json``
    (written after each): ``make_arms(p)``'s arms on a ``quant`` problem, each checked against the
    fp32 product (:func:`check`) and by each of ``checks`` (``fn(arms) -> {label: why}``), a wrong arm
    dropped, the others timed (``bench_decode.graph_timings``, graphs of ``GRAPH_CALLS`` calls) against
    ``cuBLAS`` where it is an arm, else the first; each row also names every arm's kernels
    (:func:`kernel_names`). Arms whose label starts with ``unchecked`` compute nothing (measurements of
    a part of a kernel): timed, never checked. Returns the number of cells with a wrong arm."""
    from cco.bench.timing import per_pass_ratio, time_arms
    from scripts.bench_decode import graph_timings
    from scripts.bench_sp_parts import device_problems, layer_shape

    dev = torch.device("cuda")
    rows, t0, failed = [], time.time(), 0
    for pattern, model in ((pt, md) for pt in patterns for md in args.model):
        for tp in args.tp:
            n, k, _ = layer_shape(pattern, model, tp)
            for m in args.m:
                (p,) = device_problems(m, n, k, quant, 1, dev)
                arms = make_arms(p)
                checked = {a: fn for a, fn in arms.items() if unchecked is None or not a.startswith(unchecked)}
                wrong = check(checked, p, quant)
                for more in checks:
                    wrong.update(more({a: fn for a, fn in checked.items() if a not in wrong}))
                for label, why in wrong.items():
                    print(f"{model} TP{tp} M={m} {label}: WRONG, {why}", flush=True)
                    del arms[label]
                failed += bool(wrong)
                kernels = {a: kernel_names(fn) for a, fn in arms.items()}
                t = graph_timings(arms, GRAPH_CALLS, args.passes, time_arms)
                base = "cuBLAS" if "cuBLAS" in t else next(iter(t))
                ratios = {a: per_pass_ratio(t[a].pass_us, t[base].pass_us) for a in t if a != base}
                row = {"pattern": pattern, "model": model, "tp": tp, "m": m, "n": n, "k": k, "wrong": wrong,
                       "baseline": base,
                       "us": {a: v.median_us / GRAPH_CALLS for a, v in t.items()},
                       "pass_us": {a: [u / GRAPH_CALLS for u in v.pass_us] for a, v in t.items()},
                       "vs_baseline": ratios, "kernels": kernels}
                print(f"[{time.time() - t0:.0f} s] {model} TP{tp} [{m}, {n}, {k}]: " + " | ".join(
                    f"{a} {row['us'][a]:.1f}" + (f" ({ratios[a][0]:.3f}x, {ratios[a][1]:.3f}-{ratios[a][2]:.3f})"
                                                  if a in ratios else "") for a in t), flush=True)
                if base in kernels:  # (which vendor kernel the others are held against: its tile and cluster)
                    print(f"    {base}'s kernels: {', '.join(kernels[base])}", flush=True)
                rows.append(row)
                with open(args.json, "w") as f:
                    json.dump({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "command": command,
                               "note": "device us per call, graph replay; vs_baseline: (median, min, max) over "
                                       "passes of the arm / the baseline arm, lower is better",
                               "rows": rows}, f, indent=1)
                del p, arms
                torch.cuda.empty_cache()
    return failed


if __name__ == "__main__":
    sys.exit(main())
