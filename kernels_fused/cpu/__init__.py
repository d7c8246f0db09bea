"""The CPU reference kernels: ``tiles`` computes the GEMM tile by tile in the layout's walk order, so
the CPU backend publishes tiles exactly as the device kernels do. May import: torch and the pure
contracts of ``cco``.
"""
