"""The op's executors, one per device: ``cpu`` (reference tiles, CPU transports over shared memory),
``cuda`` (the Triton kernels of ``kernels_fused.hopper``, copy engines through ``cco.cuda``) and
``gfx950`` (the FlyDSL kernel of ``kernels_fused.gfx950``, SDMA through the same stream schedule).
``base`` holds the interface and the protocol every backend follows. May import: the kernels, the
transports, ``cco.cuda`` and the pure contracts; never ``cco.op`` (the op picks a backend).
"""
