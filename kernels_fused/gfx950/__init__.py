"""The gfx950 (MI355X) fp8 GEMM in FlyDSL, emitted from ``kernels_fused.pipeline.schedule``.

``kernel`` (config, launcher, compile-to-ISA), ``stages`` (the FlyDSL pieces: loads, reads, MFMA,
the C stage and stores), ``byte_layout`` (pure address arithmetic, replayed on the host by the tests),
``toolchain`` (compile-only FlyDSL on a CPU), ``isa`` (the compiled ISA checked against the schedule),
``budget`` (the ISA by region and each variant's static budget).
May import: ``kernels_fused.pipeline`` and the pure contracts of ``cco``; flydsl only inside the
modules that build kernels. A compiled kernel is launched only on a real gfx950 device.
"""
