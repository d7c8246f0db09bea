"""Every Triton kernel that the gfx950 paths launch, compiled for gfx950 (MI355X) on the host, no GPU::

    python3 -m scripts.compile_triton_gfx950 [--part decode,transport] [--quant ptpc] [-m 1,8]
                                             [--shapes 8b-down] [--json out.json]

Two parts. ``decode``: the layer's decode calls (``kernels_fused.hopper.decode``: the one-row GEMM,
the rows kernel, ptpc's MMA over quantized rows and its one-launch form, the activation quantizer's
launches) are Triton, which targets gfx950 too, but only NVIDIA runs them today
(``cco.nn.parallel_linear.decode_gemm_for``); for each quant, row count and shape below, every
launch the decode path builds for that call (its kernel, launch options and constexprs, taken from
``decode._Launch`` and ``quantize.launch_for`` as built for a call, not restated here).
``transport``: the copy-engine schedule's Triton kernels, which ``Gfx950Backend`` launches on ROCm
through the same ``cco.cuda.dma`` schedule (``cco.cuda.kernels``' reduce, fp8 dequant and stamp
check, as ``reduce_chunk`` / ``dequant_chunk`` / ``check_stamps`` build their launches for each
pattern's regions; ``cco.cuda.memops``' spin wait, store and block wait).

Each is compiled for ``GPUTarget("hip", "gfx950", 64)`` and the code object's resource counts read:
VGPRs / AGPRs, SGPRs, spills, scratch, LDS, and whether the MMA kernels use gfx950's fp8 MFMA. A
launch fails the check where it does not compile, spills VGPRs, needs scratch, needs more LDS than a
gfx950 CU has (160 KiB), or where an MMA kernel issues no fp8 MFMA (a fallback to FMAs). Nothing
compiled here is launched, and nothing says how fast it would run. Integer arguments are specialized
as a launch would (1 as a constant, multiples of 16 as divisible; none of a kernel's
``do_not_specialize``), pointers as 16-byte aligned.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch

from cco.quant import _TINY, FP8, FP8_MAX, QUANTS
from scripts._cli import ints

SHAPES = {"8b-down": (4096, 14336), "8b-o": (4096, 4096), "70b-down-tp8": (8192, 3584)}  # (N, K)
ROWS = (1, 8, 32, 64)  # one row, the rows kernel's or MMA's 16 wide, its 32 and 64 wide forms
MMA_KERNELS = ("decode_rows_kernel", "decode_mma_rows_kernel", "decode_ptpc_kernel")  # tensor-core kernels
LDS_BYTES = 160 * 1024  # a gfx950 CU's local data share
TARGET = ("hip", "gfx950", 64)
_TYPES = {torch.bfloat16: "bf16", torch.float32: "fp32", FP8: "fp8e4nv", torch.uint8: "u8", torch.int32: "i32",
          torch.int64: "i64"}
# the transport's cases: (pattern, world, N of a rank's output slice, gather dtype); the all-reduce's
# reduce with a bf16 or fp8 gather (and the fp8 gather's dequant), the reduce-scatter's reduce into
# out, the all-gather's stamp check and block wait, at the sweeps' N (7168, Llama-3-70B's 8192 at TP 8)
TRANSPORT = (("all-reduce", 2, 7168 // 2, "bf16"), ("all-reduce", 8, 8192 // 8, "fp8"),
             ("reduce-scatter", 4, 7168, None), ("all-gather", 2, 7168, None), ("all-gather", 8, 7168, None))
PARTS = ("decode", "transport")


def transport_launches(pattern: str, world: int, n_slice: int, gather: str | None) -> list[tuple[str, object, tuple]]:
    """``(label, launch, args)`` of the copy-engine schedule's Triton launches for one call of
    ``pattern`` (``cco.cuda.kernels``' functions building them on CPU tensors of the window's
    dtypes and shapes, their launch captured instead of run; ``cco.cuda.memops``' kernels with a
    flag's and a counter's value)."""
    from cco.cuda import kernels as K
    from cco.cuda import memops
    from kernels_fused.hopper.launch import Kernel

    rows, m, e = 64, 128, torch.empty
    captured = []

    def capture(kernel, grid, args, kwargs, load_only):
        options = {key: kwargs[key] for key in ("num_warps", "num_stages") if key in kwargs}
        constexprs = [kwargs[p.name] for p in kernel.params[len(args):]]
        captured.append((kernel, grid, options, (*args, *constexprs)))

    region = e(world, rows, n_slice, dtype=torch.bfloat16)
    words = dict(scatter_m=e(world, dtype=torch.int64), status=e(K.STATUS_WORDS, dtype=torch.int64),
                 stamp=e(1, dtype=torch.int64))
    launch, K._launch = K._launch, capture
    try:
        if pattern == "all-gather":
            K.check_stamps(out=e(m, n_slice, dtype=torch.bfloat16), rank=1, world=world, **words)
        else:
            fp8 = gather == "fp8"
            gathered = e(world, rows, n_slice, dtype=FP8 if fp8 else torch.bfloat16) if gather else None
            scales = e(world, rows, K.gather_scale_cols(n_slice), dtype=torch.float32) if fp8 else None
            out = e(m, n_slice * (world if gather else 1), dtype=torch.bfloat16)
            K.reduce_chunk(partial=region, recv=region, gather=gathered, gather_scale=scales, out=out, rank=1,
                           rows=(0, rows), out_col0=None if gather else 0, **words)
            if fp8:
                K.dequant_chunk(gather=gathered, gather_scale=scales, out=out, rank=1, rows=(0, rows))
    finally:
        K._launch = launch
    found = [(f"{pattern} W={world} {kernel.__name__}", Kernel(kernel, grid, **options), args)
             for kernel, grid, options, args in captured]
    if pattern == "all-gather":  # its one spin by design (cco.cuda.dma's module note): [W, MAX_CHUNKS] words
        flags = e(world * 8, dtype=torch.int64)
        found.append((f"{pattern} W={world} block wait", Kernel(memops._block_wait_kernel(), (1,), num_warps=1),
                      (flags, 0, world, 1, 0, 4, 1, 8, world * 8)))
    return found


def word_launches() -> list[tuple[str, object, tuple]]:
    """``cco.cuda.memops``' one-word spin wait and store (the stream memory operations' stand-ins
    where a driver cannot capture those into a graph), for a flag's value (1, which a launch
    specializes to a constant) and a counter's."""
    from cco.cuda import memops
    from kernels_fused.hopper.launch import Kernel

    wait, write = memops._word_kernels()
    word = torch.empty(1, dtype=torch.int64)
    return [(f"{what} of {value}", Kernel(kernel, (1,), num_warps=1), (word, value))
            for value in (1, 7) for what, kernel in (("spin wait", wait), ("store", write))]


def _decode():
    from kernels_fused.hopper import decode as D

    return D


def launches(quant: str, m: int, n: int, k: int, dense: bool | None = None) -> list[tuple[str, object, tuple]]:
    """``(label, Kernel, args)`` of every launch a decode call of ``m`` rows of ``quant`` over an
    [n, k] weight (with a bias) builds, and of the activation quantizer's launches for ``m`` rows (the
    general path's), args in the kernel's order with dummy tensors of the real dtypes. ``dense``
    (mxfp8): the weight passed is its bf16 copy (None: as the layers pass it, from two rows on)."""
    from kernels_fused.hopper import quantize as QZ

    D = _decode()
    e = torch.empty
    x, w, bias = e(1, dtype=torch.bfloat16), e(1, dtype=FP8), e(1, dtype=torch.bfloat16)
    w_scale = e(1, dtype=torch.uint8) if quant == "mxfp8" else e(1, dtype=torch.float32)
    out, q, sa = e(1, dtype=torch.bfloat16), e(1, dtype=FP8), e(1, dtype=torch.float32)
    resident, D.resident_programs = D.resident_programs, lambda device: 256  # gfx950: 256 CUs, one program each
    try:
        if dense is None:
            dense = quant == "mxfp8" and m > 1  # the layers pass mxfp8's rows the weight's bf16 copy
        launch = D._Launch(m, k, k, n, quant, True, -1, dense=dense)
    finally:
        D.resident_programs = resident
    found = []
    scale_stride = {"ptpc": 1, "blockscale": k // 128, "mxfp8": k // 32}[quant]  # w_scale's row stride
    if launch.one is not None and launch.one_args is None:  # one row, eager (a capture takes the MMA below)
        found.append(("decode one-row GEMM (a program a row)", launch.one,
                      launch._row(x, w, w_scale, bias, out, k, scale_stride)))
    elif launch.one is not None:
        found.append(("decode one launch", launch.one, launch._one(x, q, w, w_scale, bias, out,
                                                                   e(1, dtype=torch.int32), k)))
    scales = e(1, dtype=torch.uint8) if quant == "mxfp8" else sa  # the quantizer's scales (mxfp8: e8m0 bits)
    if launch.quantize is not None:
        if launch.vendor and quant == "mxfp8":  # the rows written dequantized to bf16, no scales
            rows_bf16 = e(1, dtype=torch.bfloat16)
            found.append(("decode quantizer (bf16 rows)", launch.quantize, launch._quantize(x, rows_bf16, rows_bf16, k)))
        else:
            found.append(("decode quantizer", launch.quantize, launch._quantize(x, q, scales, k)))
    if launch.kernel is not None:
        if launch.quantize is not None:
            found.append(("decode MMA over quantized rows", launch.kernel, launch._mma(
                q, sa, w, w_scale, bias, out, e(1, dtype=torch.int32), e(1, dtype=torch.float32), scale_stride)))
        else:
            name = "decode rows kernel" if 1 < m <= D.rows_max(quant) else "decode one-row GEMM (a program a row)"
            found.append((name, launch.kernel, launch._row(x, w, w_scale, bias, out, k, scale_stride)))
    for split in ((False, True) if quant == "ptpc" else (False,)):
        kernel, consts = QZ.launch_for(quant, split, m, k, k)
        found.append((f"quantizer{' (split rows)' if split else ''}", kernel,
                      (x, q, scales, m, m, k, k, k, _TINY, FP8_MAX, *consts)))
    return found


def signature(fn, args) -> tuple[dict, dict, dict]:
    """Triton's signature, constexprs and attributes for calling ``fn`` with ``args`` as a launch
    specializes them: tensors as 16-byte aligned pointers of their dtype, an int 1 as a constant,
    an int that 16 divides as divisible (neither for ``fn``'s ``do_not_specialize``), floats fp32."""
    if len(args) != len(fn.params):
        raise ValueError(f"{fn.__name__}: {len(args)} arguments for {len(fn.params)} parameters")
    names = [p.name for p in fn.params]
    plain = {names[i] if isinstance(i, int) else i for i in getattr(fn, "do_not_specialize", ()) or ()}
    sig, consts, attrs = {}, {}, {}
    for i, (param, value) in enumerate(zip(fn.params, args)):
        name = param.name
        if param.is_constexpr or isinstance(value, bool):
            sig[name], consts[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, int):
            specialized = name not in plain
            if specialized and value == 1:
                sig[name], consts[name] = "constexpr", 1
            else:
                sig[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
                if specialized and value % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return sig, consts, attrs


def compile_gfx950(kernel, args) -> dict:
    """Compile ``kernel`` (a ``kernels_fused.hopper.launch.Kernel``: its function and launch options) with
    ``args`` for gfx950; its resource counts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    jit = kernel.fn
    sig, consts, attrs = signature(jit, args)
    options = {key: value for key, value in kernel.options.items() if key in ("num_warps", "num_stages")}
    compiled = triton.compile(ASTSource(fn=jit, signature=sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget(*TARGET), options=options)
    asm = compiled.asm["amdgcn"]

    def count(key: str) -> int:
        found = re.findall(rf"\.{key}:\s*(\d+)", asm)
        return int(found[0]) if found else 0

    return {"kernel": jit.__name__, "options": options,
            "vgpr": count("vgpr_count"), "agpr": count("agpr_count"), "sgpr": count("sgpr_count"),
            "vgpr_spills": count("vgpr_spill_count"), "sgpr_spills": count("sgpr_spill_count"),
            "scratch": count("private_segment_fixed_size"), "lds": int(compiled.metadata.shared),
            "fp8_mfma": len(re.findall(r"v_mfma\w*f8", asm)), "mfma": len(re.findall(r"v_mfma", asm))}


def faults(row: dict) -> list[str]:
    """What fails the check in a compiled launch's counts (module note)."""
    bad = []
    if row["vgpr_spills"]:
        bad.append(f"{row['vgpr_spills']} VGPR spills")
    if row["scratch"]:
        bad.append(f"{row['scratch']} bytes of scratch")
    if row["lds"] > LDS_BYTES:
        bad.append(f"{row['lds']} bytes of LDS > {LDS_BYTES}")
    if row["kernel"] in MMA_KERNELS:  # (mxfp8's rows kernel multiplies bf16: any MFMA)
        if not (row["fp8_mfma"] or row["mfma"] and row["quant"] == "mxfp8"):
            bad.append("no fp8 MFMA: the MMA fell back to FMAs")
    return bad


def _compiled(row: dict, kernel, args) -> dict:
    """``row`` with ``kernel``'s counts for ``args`` and its faults (a compile error is one)."""
    try:
        row.update(compile_gfx950(kernel, args))
        row["faults"] = faults(row)
    except Exception as err:  # recorded: a launch that does not compile fails the check
        row["faults"] = [f"does not compile: {type(err).__name__}: {str(err)[:300]}"]
    print(("ok  " if not row["faults"] else "BAD ") + _line(row), flush=True)
    return row


def check(quants=QUANTS, rows=ROWS, shapes=SHAPES, mma_stages: int | None = None, parts=PARTS) -> list[dict]:
    """Every launch of every (quant, rows, shape) (part ``decode``) and of every ``TRANSPORT`` case
    (part ``transport``), compiled; a row each, ``faults`` filled in. ``mma_stages``: the
    tensor-core kernels with this many pipeline stages instead of the layer's."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise RuntimeError("compile_triton_gfx950: TRITON_INTERPRET=1 makes every kernel an interpreted one, "
                           "which compiles to nothing; run without it")
    results = []
    if "transport" in parts:
        for label, kernel, args in [*word_launches(), *(launch for case in TRANSPORT
                                                        for launch in transport_launches(*case))]:
            results.append(_compiled({"quant": "-", "m": 0, "shape": "transport", "launch": label}, kernel, args))
    if "decode" not in parts:
        return results
    for quant in quants:
        for m in rows:
            for shape, (n, k) in shapes.items():
                built = launches(quant, m, n, k)
                if quant == "mxfp8" and 1 < m <= _decode().rows_max(quant):  # its rows over the fp8 weight too
                    built += [(label + " (fp8 weight)", kernel, args)
                              for label, kernel, args in launches(quant, m, n, k, dense=False) if "decode" in label]
                for label, kernel, args in built:
                    if mma_stages is not None and kernel.fn.__name__ in MMA_KERNELS:
                        kernel.options = {**kernel.options, "num_stages": mma_stages}
                    results.append(_compiled({"quant": quant, "m": m, "shape": shape, "launch": label}, kernel,
                                             args))
    return results


def _line(row: dict) -> str:
    head = (f"transport  {row['launch']:58s}" if row["shape"] == "transport" else
            f"{row['quant']:10s} M={row['m']:<3d} {row['shape']:13s} {row['launch']:38s}")
    if "vgpr" not in row:
        return head + " " + "; ".join(row["faults"])
    return (head + f" {row['kernel']:28s} vgpr {row['vgpr']:3d} agpr {row['agpr']:3d} sgpr {row['sgpr']:3d} "
            f"spills {row['vgpr_spills']}/{row['sgpr_spills']} lds {row['lds']:6d} fp8-mfma {row['fp8_mfma']}"
            + (f"  <- {'; '.join(row['faults'])}" if row["faults"] else ""))


def main(argv=None) -> int:
    # (the docstring's first line ends in "::", reST's literal block marker, not the description's end)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0].rstrip(":") + ".")
    p.add_argument("--part", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    p.add_argument("--quant", default=",".join(QUANTS))
    p.add_argument("-m", type=ints, default=",".join(map(str, ROWS)), help="rows of a call (>= 1)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    p.add_argument("--mma-stages", type=int, help="the tensor-core kernels with this many pipeline stages instead "
                                                  "of the layer's (what a CU's LDS allows)")
    p.add_argument("--json", help="write every launch's counts here")
    args = p.parse_args(argv)
    unknown = [q for q in args.quant.split(",") if q not in QUANTS] + [
        name for name in args.shapes.split(",") if name not in SHAPES] + [
        part for part in args.part.split(",") if part not in PARTS]
    if unknown:
        p.error(f"{unknown}: pick quants from {', '.join(QUANTS)}, shapes from {', '.join(SHAPES)} and parts from "
                f"{', '.join(PARTS)}")
    from cco.bench.timing import check_output_dirs

    check_output_dirs(p, args, ("json",))  # now, not after every launch has been compiled
    results = check(args.quant.split(","), args.m,
                    {name: SHAPES[name] for name in args.shapes.split(",")}, args.mma_stages, args.part.split(","))
    bad = [r for r in results if r["faults"]]
    print(f"{len(results) - len(bad)} of {len(results)} launches compile for gfx950 within its budget")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target": TARGET, "results": results}, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
