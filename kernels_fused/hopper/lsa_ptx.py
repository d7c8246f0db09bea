"""The lsa kernel (``fp8_gemm_lsa_kernel``) compiled for sm_90 by the installed Triton on this host
(no GPU needed), in both of its forms: the GEMM with its transfers, and the transfers on a partial
computed before (``FROM_PARTIAL``: the self test's, and a decode-sized call's after the decode MMA,
``cco.backends.cuda.DECODE_SPLIT``). Triton's interpreter, which runs the kernel in the host tests,
does not type-check a ``constexpr`` branch against the code after it; the compiler does, so a form
that only the GPU would have compiled is compiled here first. Run with another Triton on
``PYTHONPATH`` (``scripts/setup.sh`` puts the GPU machines' in ``.toolchain/triton-3.6``) to compile
with that version::

    python3 -m kernels_fused.hopper.lsa_ptx ptpc blockscale mxfp8   # exit 1 on a compile error
"""

from __future__ import annotations


def lsa_ptx_sm90(quant: str = "ptpc", *, from_partial: bool = False, fp8_gather: bool = False) -> str:
    """The PTX of ``fp8_gemm_lsa_kernel`` for sm_90 for ``quant`` at world 2 with the quant's fused
    tile (``default_config``: the lsa kernel's wherever the slice takes it, ``CudaBackend._init_lsa``),
    pointer operands, the GEMM's or ``from_partial``'s form. Not under Triton's interpreter (run it
    in a process of its own)."""
    from cco.layout import GATHER_GROUP
    from cco.quant import SCALE_BLOCK
    from kernels_fused.hopper.gemm import QUANT_ID, default_config
    from kernels_fused.hopper.kernels import fp8_gemm_lsa_kernel
    from kernels_fused.hopper.sm90 import sm90_ptx

    cfg = default_config(quant)
    operand = "*bf16" if from_partial or quant == "mxfp8" else "*fp8e4nv"  # mxfp8's arrive dequantized
    scale = operand if from_partial or quant == "mxfp8" else "*fp32"  # (unread there: any tensor)
    signature = {"ticket_ptr": "*i64", "n_tiles": "i32", "a_src": operand, "b_src": operand, "as_ptr": scale,
                 "bs_ptr": scale, "out_ptr": "*bf16", "partial_ptr": "*bf16", "recv_ptr": "*bf16",
                 "gather_ptr": "*fp8e4nv" if fp8_gather else "*bf16", "gscale_ptr": "*fp32" if fp8_gather else "*bf16",
                 "scatter_flag_ptr": "*i64", "gather_flag_ptr": "*i64", "delta_ptr": "*i64", "status_ptr": "*i64",
                 "tile_ptr": "*i32", "rank": "i32", "stamp": "i64", "plane": "i64",
                 **dict.fromkeys(("M", "N", "K", "stride_am", "stride_bn", "stride_out", "n_slice", "flag_plane",
                                  "scale_plane", "stride_asm", "stride_ask", "stride_bsn", "stride_bsk"), "i32")}
    constexprs = dict(QUANT=QUANT_ID[quant], USE_TMA=False, MX_BF16=True, PRECISE_ACC=cfg.precise_acc,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SCALE_BLOCK=SCALE_BLOCK,
                      WORLD=2, FP8_GATHER=fp8_gather, GATHER_GROUP=GATHER_GROUP, FROM_PARTIAL=from_partial,
                      MOVE_BYTES=True, NUM_PROGS=0)
    return sm90_ptx(fp8_gemm_lsa_kernel, signature, constexprs, cfg)


def main(argv=None) -> int:
    """``python -m kernels_fused.hopper.lsa_ptx [QUANT ...]``: compile both forms of the lsa kernel
    (bf16 and fp8 gathers) for sm_90 here; exit 1 if any does not compile."""
    import sys

    quants = (sys.argv[1:] if argv is None else argv) or ["ptpc"]
    failed = 0
    for quant in quants:
        for from_partial in (False, True):
            for fp8_gather in (False, True):
                what = f"{quant} {'from_partial' if from_partial else 'GEMM'} gather={'fp8' if fp8_gather else 'bf16'}"
                try:
                    ptx = lsa_ptx_sm90(quant, from_partial=from_partial, fp8_gather=fp8_gather)
                except Exception as err:  # noqa: BLE001 - reported per form, the others still compile
                    failed += 1
                    print(f"{what}: does not compile: {type(err).__name__}: {str(err).splitlines()[-1][:300]}")
                    continue
                print(f"{what}: compiled ({len(ptx)} bytes of PTX)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
