"""The reduce-scatter along rows' walk (``fp8_gemm_rows_ws_kernel``) compiled for sm_90 by the
installed Triton on this host (no GPU needed), and its releases checked in the PTX
(``kernels_fused.hopper.ptx``). Run with another Triton on ``PYTHONPATH`` (``scripts/setup.sh``
puts the GPU machines' in ``.toolchain/triton-3.6``) to read what that version makes of it:

    python3 -m kernels_fused.hopper.walk_ptx ptpc blockscale mxfp8   # exit 1 on a problem
"""

from __future__ import annotations

from kernels_fused.hopper.ptx import bulk_release_problem


def rows_ws_ptx_sm90(quant: str = "ptpc", *, release_lag: bool = False) -> str:
    """The PTX of ``fp8_gemm_rows_ws_kernel`` compiled for sm_90 by the installed Triton on this
    host (no GPU needed), as the reduce-scatter along rows' producer launches it for ``quant``
    (its fused tile at ``rows_ws_config``'s stages, world 8; ``release_lag``: each tile released
    one tile late). Not under Triton's interpreter (run it in a process of its own)."""
    from kernels_fused.hopper.gemm import default_config, rows_ws_config, rows_ws_constants
    from kernels_fused.hopper.kernels import fp8_gemm_rows_ws_kernel
    from kernels_fused.hopper.sm90 import sm90_ptx

    cfg = rows_ws_config(default_config(quant), quant)
    operand = "bf16" if quant == "mxfp8" else "fp8e4nv"  # mxfp8's operands arrive dequantized
    signature = {"a_src": f"tensordesc<{operand}[{cfg.block_m}, {cfg.block_k}]>",
                 "b_src": f"tensordesc<{operand}[{cfg.block_n}, {cfg.block_k}]>",
                 "c_desc": f"tensordesc<bf16[1, {cfg.block_m}, {cfg.block_n // 2}]>",
                 "as_ptr": "*fp32", "bs_ptr": "*fp32", "chunk_ptr": "*i32", "counter_ptr": "*i64",
                 **dict.fromkeys(("M", "N", "K", "rank", "slice_rows", "tiles_m", "stride_asm", "stride_ask",
                                  "stride_bsn", "stride_bsk"), "i32")}
    constexprs = rows_ws_constants(cfg, quant, world=8, tile_weight=1, programs=132, interpret=False,
                                   release_lag=release_lag)
    return sm90_ptx(fp8_gemm_rows_ws_kernel, signature, constexprs, cfg)


def main(argv=None) -> int:
    """``python -m kernels_fused.hopper.walk_ptx [QUANT ...]``: compile the reduce-scatter along
    rows' warp-specialized producer for sm_90 here (each tile released at once, and one tile late)
    and check its releases; exit 1 on a problem."""
    import sys

    quants = (sys.argv[1:] if argv is None else argv) or ["ptpc"]
    problems = 0
    for quant in quants:
        for lag in (False, True):
            problem = bulk_release_problem(rows_ws_ptx_sm90(quant, release_lag=lag))
            problems += problem is not None
            print(f"{quant}{' (released a tile late)' if lag else ''}: "
                  f"{problem or 'every release follows a full bulk wait and a barrier (one partition)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
