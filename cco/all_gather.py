"""AllGatherGemmOp: all-gather of fp8 input rows + GEMM, for a column-parallel layer under sequence
parallelism.

Unfused equivalent, on every rank (each rank ``r`` passes its ``[M/W, K]`` rows ``a_r``, Megatron's
convention: rank r holds rows r*M/W..(r+1)*M/W of the flattened activations)::

    a = all_gather([a_0, .., a_{W-1}], dim=0)              # e4m3 [M, K], and the scales alike
    out = reference_gemm(a, unshuffle_b(b_pre), a_scale, b_scale, quant)   # bf16 [M, N_r]

The rows travel in fp8 with their scales (half the bytes of a bf16 gather). The transport puts each
chunk of this rank's rows into every peer's ``a_rows[rank]`` slot (``cco.layout``; the copier on the
``dma`` transport, the producer's own stores on ``lsa``) while the GEMM runs on the own rows, then on
each peer's chunks as soon as their flags say they landed, a GEMM per group of a peer's consecutive
chunks (``cco.backends.cuda.AG_CONSUMER_ROWS``: fewer, fuller GEMMs where chunks are small)::

    puts     |c0 -> peers |c1 -> peers |c2 ...|
    GEMM     |own rows ...........|peer c0|peer c1|peer c2 ...|      (a group per chunk)

``mode="split"`` waits for every rank's rows before the GEMM (the baseline). With one rank the
gather is the identity and a call is the plain GEMM.

Contracts (``cco.op``, one call machinery: :class:`cco.op.CollectiveGemmOp`): collective call order
with the same rows per rank on every rank (else :class:`PeerMismatchError` on every rank), deadlines
(:class:`CommTimeoutError` naming rank, peer, chunk and seq), rejected calls
(:class:`PeerRejectedError` on the peers), recovery, graph safety (flags compared against the call's
seq, never reset), ``self_test`` (proves the rows and scales arrive bit-exact), ``close``. Output: a
new bf16 ``[W * m, n]`` tensor per call; with ``return_a=True`` also the gathered e4m3 ``[W * m, K]``
input and its scales in ``quant``'s layout (new tensors, for a backward that needs them).
"""

from __future__ import annotations

import torch

from cco import layout
from cco.op import DEFAULT_DEADLINE_S, CollectiveGemmOp
from cco.quant import E8M0

_FN = "AllGatherGemmOp"
_POISON = 0xFF  # the byte a self test fills received slots with (e4m3 and e8m0 NaN; a byte no probe writes)


class AllGatherGemmOp(CollectiveGemmOp):
    """Fused all-gather of fp8 rows + fp8 GEMM over the ranks of ``comm``.

    Arguments (all but ``comm`` keyword-only): as :class:`cco.op.GemmAllReduceOp` (``n``: this rank's
    output columns N_r, ``k``, ``quant``, ``mode`` "fused" | "split", ``transport``, ``chunks``,
    ``weight_layout``, ``deadline_s``, ``faults``) without ``gather_dtype`` (the rows travel in
    fp8), and
      m_max: the most gathered rows (M) a call returns: each rank passes at most m_max // W rows.
    """

    _FN = _FN

    def __init__(self, comm, *, n: int, k: int, m_max: int, quant: str = "ptpc", mode: str = "fused",
                 transport: str | None = None, chunks: int | tuple[int, ...] | None = None,
                 deadline_s: float = DEFAULT_DEADLINE_S, faults=None, weight_layout: str = "bpreshuffle"):
        super().__init__(comm, pattern="all-gather", faults=faults, arguments=dict(
            n=n, k=k, m_max=m_max, quant=quant, mode=mode, transport=transport, gather_dtype="bf16",
            chunks=chunks, deadline_s=deadline_s, weight_layout=weight_layout))

    def __call__(self, a, b_pre, a_scale, b_scale, *, return_a: bool = False, tag: int = 0):
        """bf16 ``[W * m, n]`` for this rank's rows ``a [m, K]``: every rank's rows, in rank order,
        times this rank's weight. ``return_a``: ``(out, a_all, a_scale_all)``. ``tag``: the caller,
        stamped with the call (``ScatterGemmOp.__call__``)."""
        self._tag = tag
        if not return_a:
            launch = self._launches.launch_for(a, b_pre, a_scale, b_scale)  # one rank: the plain GEMM, kept
            if launch is not None and layout.valid_tag(tag):  # (else _call rejects it)
                self._seq += self._alone
                return launch(a, a_scale)
            return self._call(a, b_pre, a_scale, b_scale, self._gather_call)
        gathered = []

        def run(a, b_pre, a_scale, b_scale, m):
            out, a_all, s_all = self._gather_call(a, b_pre, a_scale, b_scale, m, with_a=True)
            gathered[:] = (a_all, s_all)
            return out

        out = self._call(a, b_pre, a_scale, b_scale, run)
        if not gathered:  # a plain call (one rank): the gathered input is the own
            gathered = [a.clone(), self._scale_like(a_scale, a.shape[0])]
            gathered[1].copy_(a_scale)
        return out, *gathered

    def _scale_like(self, a_scale: torch.Tensor, rows: int) -> torch.Tensor:
        """A new scale tensor of ``rows`` rows in ``a_scale``'s layout (blockscale: column-major)."""
        if self.config.quant == "blockscale":
            return torch.empty(a_scale.shape[1], rows, dtype=a_scale.dtype, device=a_scale.device).t()
        return torch.empty(rows, *a_scale.shape[1:], dtype=a_scale.dtype, device=a_scale.device)

    def _gather_call(self, a, b_pre, a_scale, b_scale, m: int, *, with_a: bool = False):
        total = m * self.world
        out = torch.empty(total, self.config.n, dtype=torch.bfloat16, device=self.comm.device)
        a_scale, as_passed = self._as_slot(a_scale)
        gathered = None
        if with_a:
            gathered = (torch.empty(total, self.config.k, dtype=a.dtype, device=a.device),
                        self._scale_like(a_scale, total))
        self._collective(lambda plan: self._backend.all_gather_gemm(a, b_pre, a_scale, b_scale, out=out, plan=plan,
                                                                   gathered=gathered), m, self._tag)
        return out if not with_a else (out, gathered[0], as_passed(gathered[1]))

    def _as_slot(self, a_scale: torch.Tensor):
        """(``a_scale`` as the window's scale slot holds it, a function giving a gathered scale back
        in ``a_scale``'s own form): the forms the checks accept besides the slot's own, mxfp8's uint8
        bits (a copy into the e8m0 slot would convert their values: every rank's product wrong) and
        ptpc's ``[M, 1]``, as views."""
        quant = self.config.quant
        if quant == "mxfp8" and a_scale.dtype == torch.uint8:
            return a_scale.view(E8M0), lambda s: s.view(torch.uint8)
        if quant == "ptpc" and a_scale.dim() == 2:
            return a_scale.reshape(-1), lambda s: s.view(-1, 1)
        return a_scale, lambda s: s

    def out_shape(self, m: int) -> tuple[int, int]:
        """The output shape of a call with ``m`` rows per rank."""
        return layout.out_shape(self.config, m)

    # ---- self test: the rows and scales of every rank arrive bit-exact ---------------------------------
    def _slots(self, rank: int, m: int):
        """(rows slot, scales slot) of source ``rank`` in this rank's window, the first ``m`` rows."""
        w = self.config.window
        rows = self.window.tensor(w.a_rows, rank=self.rank)[rank][:m]
        scales = self.window.tensor(w.a_scales, rank=self.rank)[rank]
        scales = scales[:, :m] if self.config.quant == "blockscale" else scales[:m]
        return rows, scales

    @staticmethod
    def _probe_bytes(count: int, src: int, seq: int, salt: int) -> torch.Tensor:
        """``count`` uint8 bytes that name (source, position, seq); never ``_POISON``."""
        return ((torch.arange(count) * 7 + 31 * src + 13 * seq + salt) % _POISON).to(torch.uint8)

    def _expected(self, src: int, m: int, seq: int):
        """The bytes of source ``src``'s rows and scales slots (row-major), as its probe wrote them."""
        return [self._probe_bytes(t.numel() * t.element_size(), src, seq, salt)
                for salt, t in enumerate(self._slots(src, m))]

    def _probe_prepare(self, m: int, seq: int) -> None:
        w = self.config.window
        for region in (w.a_rows, w.a_scales):
            self.window.tensor(region, rank=self.rank).view(torch.uint8).fill_(_POISON)
        for t, want in zip(self._slots(self.rank, m), self._expected(self.rank, m, seq)):
            t.copy_(want.to(t.device).view(t.dtype).reshape(t.shape))  # same dtype: the bytes as they are
        if self.window.device.type == "cuda":
            torch.cuda.synchronize(self.window.device)

    def _probe_run(self, plan):
        self._backend.gather_inputs_window(plan=plan)

    def _probe_problems(self, m: int, seq: int, result) -> list[str]:
        problems = []
        for src in range(self.world):
            for what, got, want in zip(("rows", "scales"), self._slots(src, m), self._expected(src, m, seq)):
                got_bytes = got.contiguous().view(torch.uint8).reshape(-1).cpu()
                if not torch.equal(got_bytes, want):
                    bad = int((got_bytes != want).sum())
                    problems.append(f"rank {self.rank}: {bad} of {want.numel()} bytes of the input {what} from rank "
                                    f"{src} did not arrive")
        return problems

    def _probe_report(self, m: int) -> dict:
        rows, scales = self._slots(self.rank, m)
        moved = (self.world - 1) * (rows.numel() * rows.element_size() + scales.numel() * scales.element_size())
        return {"input_bytes_received": moved,
                "checked": "every rank's input rows and scales arrived bit-exact in every slot"}
