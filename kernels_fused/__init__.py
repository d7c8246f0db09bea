"""kernels_fused: the pipeline schedule of the 8-wave gfx950 fp8 GEMM and its checkers, the FlyDSL
kernel emitted from that schedule, the Triton kernels for NVIDIA (the GEMM, and the lsa transport's
one-launch GEMM + all-reduce), and the CPU reference tiles.

Exports are resolved lazily: the schedule, checker and simulator need only torch and numpy; the gfx950
kernel needs flydsl (compile-only on a CPU); the NVIDIA kernel needs triton.
"""

from importlib import import_module

_EXPORTS = {
    "build_schedule": "kernels_fused.schedule",
    "VARIANTS": "kernels_fused.schedule",
    "check": "kernels_fused.happens_before",
    "run_launches": "kernels_fused.simulator",
    "LatencyModel": "kernels_fused.simulator",
    "compile_fused_gemm_scatter": "kernels_fused.gemm_gfx950",
    "compile_to_isa": "kernels_fused.gemm_gfx950",
    "fp8_gemm": "kernels_fused.triton_gemm",
    "fp8_gemm_lsa": "kernels_fused.triton_gemm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kernels_fused' has no attribute {name!r}")
