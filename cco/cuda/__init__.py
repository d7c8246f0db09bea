"""CUDA pieces of the op: stream memory operations and copy-engine puts (``memops``), the reduce and
gather kernels (``kernels``), the per-call stream schedule of the ``dma`` transport (``dma``), and
the deadline of the device-side waits (``watchdog``).

Nothing here is imported by ``import cco``; ``cco.backends.cuda`` pulls it in on a CUDA device.
"""
