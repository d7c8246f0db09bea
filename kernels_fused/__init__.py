"""kernels_fused: the GEMM kernels of the op, one folder per target, and the proof of the gfx950 one.

- ``pipeline/``: the 8-wave gfx950 pipeline as data (``schedule``) and what walks it without a GPU:
  the happens-before race checker, the latency simulator and their command lines.
- ``gfx950/``: the FlyDSL kernel emitted from that schedule, its byte layout, its toolchain, and the
  ISA matcher that checks the compiled code against the schedule.
- ``hopper/``: the Triton kernels for NVIDIA (host side and device code).
- ``cpu/``: the reference tiles the CPU backend runs.

May import: the pure contracts of ``cco`` (``cco.layout``, ``cco.quant``, ``cco.preshuffle``,
``cco.validate``); never the op, the backends, the transports or the communicator (the runtime uses
the kernels, not the other way round: ``tests/python/cco/test_imports.py``). Exports resolve lazily:
the pipeline needs torch and numpy, the gfx950 kernel flydsl (compile-only on a CPU), hopper triton.
"""

from importlib import import_module

_EXPORTS = {
    "build_schedule": "kernels_fused.pipeline.schedule",
    "VARIANTS": "kernels_fused.pipeline.schedule",
    "check": "kernels_fused.pipeline.happens_before",
    "run_launches": "kernels_fused.pipeline.simulator",
    "LatencyModel": "kernels_fused.pipeline.simulator",
    "compile_fused_gemm_scatter": "kernels_fused.gfx950.kernel",
    "compile_to_isa": "kernels_fused.gfx950.kernel",
    "fp8_gemm": "kernels_fused.hopper.gemm",
    "fp8_gemm_lsa": "kernels_fused.hopper.gemm",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kernels_fused' has no attribute {name!r}")
