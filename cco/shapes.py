"""Which shapes run fused on which backend, and the zero padding that makes a layer's shape run.

``cco.supports`` answers for the backend that will run the call: it asks that backend for its tiles
(``Backend.tile``), builds the op's configuration with them (``cco.layout.build_config``, the single
place that decides what is expressible), then asks the backend what it refuses at construction
(``Backend.config_error``, which its own ``__init__`` raises). So a ``None`` here means
``GemmAllReduceOp`` builds, and a reason is the error it would raise, with the fix::

    cco.supports(4096, 3584, 2432, 8, backend="cuda")
    # "cuda: block_n=128 (the backend's tile width) must divide the per-rank slice N/world =
    #  3584/8 = 448; pad N with zero weight rows to n=4096 (...)"

:func:`layer_shape` is the plan of ``cco.nn.RowParallelLinear``: the smallest padded ``(N', K')``
the backend accepts (zero weight rows and columns, added once at load; zero activation columns,
written by the layer's quantization kernel) and, where even that cannot run fused, why.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cco import layout

BACKENDS = ("cpu", "cuda", "gfx950")  # Backend.name of every backend


def backend_class(*, device=None, backend: str | None = None):
    """The backend class that runs on ``device`` (a torch device; None: this process's, the current
    GPU or the CPU), or the one named ``backend`` (``BACKENDS``; no device needed)."""
    if backend is not None:
        if backend == "cpu":
            from cco.backends.cpu import CpuBackend
            return CpuBackend
        if backend == "cuda":
            from cco.backends.cuda import CudaBackend
            return CudaBackend
        if backend == "gfx950":
            from cco.backends.gfx950 import Gfx950Backend
            return Gfx950Backend
        raise ValueError(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    from cco.op import select_backend

    return select_backend(default_device() if device is None else device)


def default_device() -> torch.device:
    """The device this process would run a layer on: the current GPU, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build_for(backend_cls, *, n: int, k: int, m_max: int, world: int, **options) -> layout.OpConfig:
    """``layout.build_config`` with the backend's tiles and defaults, as ``GemmAllReduceOp`` builds it.
    Raises ValueError with the backend's reason, prefixed by its name."""
    quant = options.get("quant", "ptpc")
    block_m, block_n = backend_cls.tile(quant) if quant in layout.QUANTS else (None, None)
    options.setdefault("chunks", backend_cls.default_chunks)
    options.setdefault("default_transport", backend_cls.default_transport)
    try:
        cfg = layout.build_config(n=n, k=k, m_max=m_max, world=world, block_m=block_m, block_n=block_n, **options)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{backend_cls.name}: {err}") from None
    refused = backend_cls.config_error(cfg)
    if refused is not None:
        raise ValueError(f"{backend_cls.name}: {refused}")
    return cfg


# the options of ``supports``: the ops' that decide whether a shape runs fused, and the ones that do not
SUPPORTS_OPTIONS = ("quant", "mode", "transport", "gather_dtype", "chunks", "weight_layout", "m_max", "pattern",
                    "scatter_dim")
SHAPELESS_OPTIONS = ("deadline_s", "faults")


def supports(m: int, n: int, k: int, world: int, *, device=None, backend: str | None = None,
             **options) -> str | None:
    """``None`` when the backend of ``device`` (or the one named ``backend``) runs ``[m, k] x [n, k]``
    over ``world`` ranks fused, else the reason and the fix.

    ``options`` are ``GemmAllReduceOp``'s (quant, mode, transport, gather_dtype, chunks,
    weight_layout, m_max; m_max defaults to m), and ``pattern`` (``layout.PATTERNS``) or, as
    ``GemmReduceScatterOp`` takes it, ``scatter_dim``. ``m`` is a call's rows as the op takes them
    (the all-gather: this rank's). A concrete ``device`` is also asked whether the backend can run
    there (Triton installed, stream memory operations, a gfx950 GPU). An option of another name
    raises TypeError (``deadline_s`` and ``faults`` are taken and have no bearing on the shape)."""
    unknown = sorted(set(options) - set(SUPPORTS_OPTIONS) - set(SHAPELESS_OPTIONS))
    if unknown:  # a programming error, not a shape the backend refuses: never a reason to run unfused
        raise TypeError(f"cco.supports: unknown option(s) {', '.join(unknown)}; it takes the op's "
                        f"({', '.join(SUPPORTS_OPTIONS + SHAPELESS_OPTIONS)})")
    options = {k: v for k, v in options.items() if k not in SHAPELESS_OPTIONS}
    try:
        backend_cls = backend_class(device=device, backend=backend)
    except ValueError as err:
        return str(err)
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        return f"m={m!r} must be a positive int"
    if "scatter_dim" in options:
        if "pattern" in options:
            return "pass pattern or scatter_dim, not both"
        try:
            options["pattern"] = layout.reduce_scatter_pattern(options.pop("scatter_dim"))
        except ValueError as err:
            return str(err)
    gathers = options.get("pattern") == "all-gather"
    m_max = options.pop("m_max", m * world if gathers else m)
    try:
        cfg = build_for(backend_cls, n=n, k=k, m_max=m_max, world=world, **options)
    except ValueError as err:
        return str(err)
    refused = layout.call_rows_error(cfg, m)
    if refused is not None:
        return f"{backend_cls.name}: {refused}"
    if backend is None:
        why = backend_cls.supports_device(default_device() if device is None else torch.device(device))
        if why is not None:
            return f"{backend_cls.name}: {why}"
    return None


@dataclass(frozen=True)
class LayerShape:
    """How a row-parallel layer's ``[n, k]`` weight shard runs on a backend: padded to
    ``[n_padded, k_padded]`` (zeros), fused unless ``reason`` says why not."""

    backend: str
    n: int
    k: int
    n_padded: int
    k_padded: int
    reason: str | None  # None: fused

    @property
    def fused(self) -> bool:
        return self.reason is None

    @property
    def padding(self) -> str:
        """``""`` or what was padded, e.g. ``"N 3584->4096 (+14.3%)"``."""
        parts = [f"{name} {a}->{b} (+{100 * (b - a) / a:.1f}%)"
                 for name, a, b in (("N", self.n, self.n_padded), ("K", self.k, self.k_padded)) if b != a]
        return ", ".join(parts)


def layer_shape(n: int, k: int, world: int, *, m_max: int, device=None, backend: str | None = None,
                **options) -> LayerShape:
    """The plan of a row-parallel layer with ``n`` output features and ``k`` input features per
    rank: the smallest zero padding the backend accepts (whole tiles of the backend's width per
    rank, whole 128-wide K tiles, at least two), and whether it then runs fused."""
    try:
        backend_cls = backend_class(device=device, backend=backend)
    except ValueError as err:
        return LayerShape(backend="none", n=n, k=k, n_padded=n, k_padded=k, reason=str(err))
    quant = options.get("quant", "ptpc")
    block_n = backend_cls.tile(quant)[1] if quant in layout.QUANTS else None
    # a pattern whose slices are rows (reduce-scatter along tokens, all-gather) tiles all N columns
    pattern = layout.PATTERNS.get(options.get("pattern", "all-reduce"))
    slices = 1 if pattern is not None and pattern.owner_by == "rows" else world
    n_padded = layout.padded_n(n, slices, quant=quant, block_n=block_n) if quant in layout.QUANTS else n
    k_padded = layout.padded_k(k)
    # asked for the largest call the op takes (supports checks a call's rows)
    m = layout.most_call_rows(options.get("pattern", "all-reduce"), m_max, world)
    reason = supports(max(m, 1), n_padded, k_padded, world, device=device, backend=backend, m_max=m_max, **options)
    return LayerShape(backend=backend_cls.name, n=n, k=k, n_padded=n_padded, k_padded=k_padded, reason=reason)
