"""The NVIDIA (Hopper) kernels in Triton: the fp8 GEMM in its plain, fused (tile table + counters)
and lsa (one-launch GEMM + all-reduce) forms. ``gemm`` is the host side (configs, formats, tile
walks, launches), ``kernels`` the device code. May import: triton (lazily) and the pure contracts of
``cco``.
"""
