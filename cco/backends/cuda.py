"""NVIDIA backend: the Triton fp8 GEMM (``kernels_fused.triton_gemm``) and the copy-engine ``dma``
transport (``cco.cuda.dma``) over a torch symmetric-memory window.

What runs where, per call (details and the stream diagram in ``cco.cuda.dma``):

- ``gemm``: one Triton launch writing ``out`` directly.
- ``fused``: one Triton launch with the fused epilogue (tiles into ``partial[dest]`` in the layout's
  (chunk, dest, m, n) order, one release add per tile on ``counters[dest, chunk]``; where the GEMM's
  best tile is two layout tiles wide, one program covers a pair and adds 2); copy-engine puts start
  on each (dest, chunk) as soon as its counter completes, while the GEMM still runs; reduce, gather
  and assemble follow chunk by chunk on side streams.
- ``split``: the same launch, then the same transfers gated on the whole GEMM (the baseline).

The weight arrives in the gfx950 bpreshuffle layout; the Triton kernel reads row-major ``[N, K]``,
so the backend keeps the unshuffled copy of the last weights it saw (keyed by storage and version:
an in-place update of the weight is noticed).

Deviation from the protocol text of ``cco.backends.base``: every counter and flag has one waiter, and
that waiter zeroes it after its wait, and the counters are zeroed at each call's start. A stream
wait's target is baked into a captured CUDA graph, so monotonic words would let a replayed wait pass
at once; consumed words keep every replay correct. Flags still carry the call's seq.

Only the ``dma`` transport is implemented on CUDA; ``lsa`` raises at construction. Small M: at
N=7168, K=2048 on 2 H200 the fused op does not beat ``_scaled_mm`` + NCCL below M = 4096, but it
beats ``split`` at every M measured, so no fallback to ``split`` is made (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import torch

from cco import layout
from cco.backends.base import Backend
from cco.preshuffle import unshuffle_b
from cco.transport.protocol import PeerMismatchError

GEMM_BLOCK_M = 128  # wgmma-friendly tile rows; also the layout's m-tile (chunk granularity)
GEMM_BLOCK_N = 128  # divides N/world for N = 7168 up to 8 ranks; ptpc gemm-only uses 128x256


class CudaBackend(Backend):
    name = "cuda"
    block_m = GEMM_BLOCK_M
    block_n = GEMM_BLOCK_N

    @classmethod
    def supports_device(cls, device):
        device = torch.device(device)
        if device.type != "cuda" or getattr(torch.version, "hip", None):
            return f"CudaBackend runs on NVIDIA CUDA devices, not {device}"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "CudaBackend needs triton (pip install triton)"
        from cco.cuda.memops import supports_mem_ops

        return supports_mem_ops(device.index or 0)

    def _refuse_lost_puts(self, runtime: str) -> None:
        if self.faults is not None and self.faults.drops:
            raise ValueError(f"{type(self).__name__}: lost-put faults (FaultPlan.drops) cannot be injected on "
                             f"{runtime}: device-side waits have no deadline, so a lost put would hang; "
                             f"use FaultPlan(silent=True)")

    def __init__(self, **kw):
        super().__init__(**kw)
        cfg = self.config
        if cfg.transport != "dma":
            raise ValueError(f"CudaBackend: transport={cfg.transport!r} is not implemented on CUDA; pass transport='dma'")
        self._refuse_lost_puts("CUDA")
        faults = self.faults
        from cco.cuda.dma import CopyEngineSchedule
        from kernels_fused.triton_gemm import GemmConfig, default_config

        self.device = self.window.device
        self.rank, self.world = self.window.rank, self.window.world
        self.schedule = CopyEngineSchedule(config=cfg, window=self.window, device=self.device,
                                           silent=bool(faults is not None and faults.silent))
        base = default_config(cfg.quant)
        # the fused launch may use a tile two layout tiles wide (same order, counts for both)
        wide = (base.block_n == 2 * cfg.block_n and cfg.n_tiles_per_dest % 2 == 0 and base.block_m == cfg.block_m)
        self.tile_weight = 2 if wide else 1
        self.fused_config = GemmConfig(block_m=cfg.block_m, block_n=cfg.block_n * self.tile_weight,
                                       num_warps=base.num_warps, num_stages=base.num_stages, tma=base.tma)
        self.gemm_config = base
        w = cfg.window
        self.partial = self.window.tensor(w.partial, rank=self.rank)
        self.counters = self.window.words(w.counters, rank=self.rank)
        self._tables: dict[int, torch.Tensor] = {}
        self._weight_key = None
        self._weight = None

    # ---- helpers ------------------------------------------------------------------------------------
    def _unshuffled(self, b_pre: torch.Tensor) -> torch.Tensor:
        key = (b_pre.data_ptr(), b_pre._version, tuple(b_pre.shape))
        if key != self._weight_key:
            self._weight = unshuffle_b(b_pre)
            self._weight_key = key
        return self._weight

    def _table(self, plan) -> torch.Tensor:
        table = self._tables.get(plan.m)
        if table is None:
            from kernels_fused.triton_gemm import merge_tile_pairs, tile_table_tensor

            rows = layout.tile_table_rows(plan.tiles)
            if self.tile_weight == 2:
                rows = merge_tile_pairs(rows, layout_block_n=self.config.block_n)
            table = tile_table_tensor(rows, device=self.device)
            self._tables[plan.m] = table
        return table

    def _fused_gemm(self, a, b_pre, a_scale, b_scale, plan) -> None:
        from kernels_fused.triton_gemm import fp8_gemm

        self.counters.zero_()  # see the module note: consumed words, zero at the call's start
        self.schedule.begin(plan)
        fp8_gemm(a, self._unshuffled(b_pre), a_scale, b_scale, quant=self.config.quant, out=self.partial,
                 fuse=True, tile_table=self._table(plan), counters=self.counters, tile_weight=self.tile_weight,
                 config=self.fused_config)

    # ---- modes --------------------------------------------------------------------------------------
    def gemm(self, a, b_pre, a_scale, b_scale, *, out, plan):
        from kernels_fused.triton_gemm import fp8_gemm

        fp8_gemm(a, self._unshuffled(b_pre), a_scale, b_scale, quant=self.config.quant, out=out,
                 config=self.gemm_config)

    def fused(self, a, b_pre, a_scale, b_scale, *, out, plan):
        self._fused_gemm(a, b_pre, a_scale, b_scale, plan)
        self.schedule.run(plan, out, after_gemm=False)

    def split(self, a, b_pre, a_scale, b_scale, *, out, plan):
        self._fused_gemm(a, b_pre, a_scale, b_scale, plan)
        self.schedule.run(plan, out, after_gemm=True)

    def all_reduce_window(self, *, out, plan):
        self.counters.zero_()
        self.schedule.begin(plan)
        self.schedule.set_counters(plan)
        self.schedule.run(plan, out, after_gemm=True)

    def check(self) -> None:
        """Synchronize and raise :class:`PeerMismatchError` if a reduce saw another rank's (seq, m)."""
        status = self.schedule.check()
        if status:
            raise PeerMismatchError(
                f"rank {self.rank}: rank {status - 1} stamped another (seq, M) than this rank for the same call; "
                f"every rank must call with the same M, in the same order")

    def close(self):
        if self.schedule is not None:
            torch.cuda.synchronize(self.device)
            self.schedule.close()
            self.schedule = None
