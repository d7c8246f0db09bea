"""The 8-wave gfx950 fp8 GEMM pipeline as data, and everything that walks it without a GPU.

``schedule`` is the single source of truth (the FlyDSL emitter in ``kernels_fused.gfx950`` walks
it too); ``happens_before`` proves every LDS read covered, ``simulator`` runs a schedule on real
fp8 data under random DMA latencies; ``verify`` and ``simulate`` are their command lines.
May import: torch, numpy and ``cco.quant``; nothing from the other kernel folders or a GPU library.
"""
