"""Symmetric windows: one buffer per rank, laid out by ``cco.layout.WindowLayout``, that every rank
can read and write.

- :class:`ShmWindow` (no GPU): one ``/dev/shm`` file per rank, mapped by every rank process, so the
  CPU path moves bytes between processes exactly as the GPU path moves them between devices. Files
  are unlinked as soon as every rank has mapped them: a crash leaves nothing behind.
- :class:`SymmetricMemoryWindow` (CUDA and ROCm): torch symmetric memory, peer-mapped device memory.
- :class:`IpcWindow` (CUDA): device memory shared through CUDA IPC handles, for ranks that share a GPU
  (torch symmetric memory refuses them). The bytes then never cross a link, so such a job checks the
  protocol, not the speed.

Both are created collectively (every rank, same layout) and zero-filled before first use.
"""

from __future__ import annotations

import abc
import hashlib
import mmap
import os
import platform
import secrets
import tempfile

import torch

from cco.layout import Region, WindowLayout

_SHM_DIR = "/dev/shm"
_TSO_MACHINES = ("x86_64", "AMD64", "i686", "i386")  # see cco.transport.protocol on ordering


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


class Window(abc.ABC):
    """A symmetric window: ``tensor(region, rank=r)`` is a typed view of rank r's copy of a region."""

    def __init__(self, *, comm, layout: WindowLayout):
        self.comm = comm
        self.layout = layout
        self.rank = comm.rank
        self.world = comm.world
        self._closed = False

    @abc.abstractmethod
    def _raw(self, rank: int) -> torch.Tensor:
        """The whole window of ``rank`` as a 1-D uint8 tensor."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device: ...

    def tensor(self, region: Region, *, rank: int) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("Window.tensor: the window is closed")
        if not 0 <= rank < self.world:
            raise ValueError(f"Window.tensor: rank={rank} is outside 0..{self.world - 1}")
        raw = self._raw(rank)[region.offset: region.offset + region.nbytes]
        return raw.view(_torch_dtype(region.dtype)).view(region.shape)

    def words(self, region: Region, *, rank: int) -> torch.Tensor:
        """An int64 region of rank ``rank`` flattened (index it with ``layout.counter_index``)."""
        assert region.dtype == "int64", region
        return self.tensor(region, rank=rank).view(-1)

    def barrier(self) -> None:
        self.comm.barrier()

    @abc.abstractmethod
    def _release(self) -> None: ...

    def close(self) -> None:
        """Unmap (collective-free, idempotent). Views handed out earlier must not be used after."""
        if not self._closed:
            self._closed = True
            self._release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class ShmWindow(Window):
    """CPU window over shared-memory files, one per rank, mapped by all ranks of the communicator."""

    def __init__(self, *, comm, layout: WindowLayout):
        super().__init__(comm=comm, layout=layout)
        if platform.machine() not in _TSO_MACHINES:
            raise RuntimeError(
                f"ShmWindow: machine {platform.machine()!r} is not x86-64; the CPU protocol relies on "
                f"its store ordering (see cco.transport.protocol)"
            )
        directory = _SHM_DIR if os.path.isdir(_SHM_DIR) else tempfile.gettempdir()
        token = comm.broadcast_object(secrets.token_hex(8) if comm.rank == 0 else None)
        paths = [os.path.join(directory, f"cco-window-{token}-{r}") for r in range(self.world)]
        nbytes = max(layout.nbytes, 1)
        fd = os.open(paths[self.rank], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)  # zero-filled
        finally:
            os.close(fd)
        self._maps: list[mmap.mmap] = []
        try:
            comm.barrier()  # every file exists
            for path in paths:
                fd = os.open(path, os.O_RDWR)
                try:
                    self._maps.append(mmap.mmap(fd, nbytes))
                finally:
                    os.close(fd)
            comm.barrier()  # every rank has mapped every file
        finally:
            os.unlink(paths[self.rank])
        self._views = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _raw(self, rank: int) -> torch.Tensor:
        return self._views[rank]

    def _release(self) -> None:
        self._views = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a caller still holds a view; the map goes with it
                pass
        self._maps = []


class SymmetricMemoryWindow(Window):
    """CUDA/ROCm window in torch symmetric memory (peer-mapped over NVLink / xGMI)."""

    def __init__(self, *, comm, layout: WindowLayout):
        super().__init__(comm=comm, layout=layout)
        import torch.distributed._symmetric_memory as symm_mem  # device-only import

        self._device = comm.device
        self._buf = symm_mem.empty(max(layout.nbytes, 1), dtype=torch.uint8, device=self._device)
        self._buf.zero_()
        self._handle = symm_mem.rendezvous(self._buf, comm.group)
        self._peers = [self._handle.get_buffer(r, (self._buf.numel(),), torch.uint8, 0)
                       for r in range(self.world)]
        torch.cuda.synchronize(self._device)
        comm.barrier()

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def handle(self):
        """The torch symmetric-memory handle (signal pads, buffer pointers) for device kernels."""
        return self._handle

    def _raw(self, rank: int) -> torch.Tensor:
        return self._peers[rank]

    def _release(self) -> None:
        self._peers, self._handle, self._buf = [], None, None


class _DevicePointer:
    """A device byte range as a CUDA array (``torch.as_tensor`` then views it without a copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}


# Own allocations of closed IPC windows that a peer may still map. CUDA leaves freeing an exported
# allocation before every importer closed its mapping undefined (cuIpcOpenMemHandle), and closing is
# local: a rank closes its window while a peer still maps it, or still calls and writes into it (a
# rank that closed its op early: cco.op). Each is freed once every peer has posted in the store that
# it unmapped it, checked whenever this process opens or closes an IPC window; the rest go with the
# process (its context's teardown).
_UNFREED: list = []  # (pointer, the store, the peers' keys)


def _free_unmapped() -> None:
    """Free every allocation in ``_UNFREED`` that no peer maps any longer."""
    from cco.cuda.memops import mem_free
    from cco.transport.store import within

    for entry in list(_UNFREED):
        ptr, store, keys = entry
        if within(lambda: store.check(keys)):
            _UNFREED.remove(entry)
            mem_free(ptr)


class IpcWindow(Window):
    """CUDA window in device memory of its own (``cuMemAlloc``), mapped into every rank process through
    CUDA IPC handles. Works when ranks share a GPU, where torch symmetric memory refuses. Closing it
    unmaps the peers' allocations at once and frees the own one once every peer has unmapped it
    (``_UNFREED``)."""

    def __init__(self, *, comm, layout: WindowLayout):
        super().__init__(comm=comm, layout=layout)
        from cco.cuda.memops import ipc_export, ipc_open, mem_alloc

        self._device = comm.device
        nbytes = max(layout.nbytes, 1)
        torch.cuda.synchronize(self._device)  # makes the device's primary context current for the driver
        _free_unmapped()
        self._own = mem_alloc(nbytes)
        self._opened: list[int] = []
        self._unmapped_key = None  # the store key prefix of this window's "unmapped" posts, once mapped
        try:
            handles = comm.all_gather_object(ipc_export(self._own))
            self._unmapped_key = f"cco/ipc/{hashlib.sha1(b''.join(handles)).hexdigest()[:16]}/unmapped/"
            ptrs = []
            for r, handle in enumerate(handles):
                if r == self.rank:
                    ptrs.append(self._own)
                else:
                    ptrs.append(ipc_open(handle))
                    self._opened.append(ptrs[-1])
        except BaseException:
            self._release()
            raise
        self._peers = [torch.as_tensor(_DevicePointer(p, nbytes), device=self._device) for p in ptrs]
        self._peers[self.rank].zero_()
        torch.cuda.synchronize(self._device)
        comm.barrier()

    @property
    def device(self) -> torch.device:
        return self._device

    def _raw(self, rank: int) -> torch.Tensor:
        return self._peers[rank]

    def _release(self) -> None:
        from cco.cuda.memops import ipc_close, mem_free
        from cco.transport.store import store_of, within

        self._peers = []
        for ptr in self._opened:
            ipc_close(ptr)
        self._opened = []
        if self._own is None:
            return
        own, self._own = self._own, None
        if self._unmapped_key is None or self.world == 1:  # no handle went out: no peer maps it
            mem_free(own)
            return
        try:
            store = store_of(self.comm)
        except Exception:  # noqa: BLE001 - no store to tell (no process group left): kept until the process exits
            return
        within(lambda: store.set(f"{self._unmapped_key}{self.rank}", "1"))
        _UNFREED.append((own, store, [f"{self._unmapped_key}{r}" for r in range(self.world) if r != self.rank]))
        _free_unmapped()


def ranks_share_a_device(comm) -> bool:
    """Whether two ranks of ``comm`` run on the same GPU of the same host."""
    props = torch.cuda.get_device_properties(comm.device)
    keys = comm.all_gather_object((platform.node(), str(getattr(props, "uuid", comm.device))))
    return len(set(keys)) < len(keys)


def open_window(*, comm, layout: WindowLayout) -> Window:
    """The window kind for the communicator's device: shared memory on CPU, symmetric memory on GPU,
    CUDA IPC where ranks share an NVIDIA GPU."""
    if comm.device.type == "cpu":
        return ShmWindow(comm=comm, layout=layout)
    if ranks_share_a_device(comm):
        if getattr(torch.version, "hip", None):
            raise RuntimeError(f"open_window: ranks share {comm.device}; on ROCm every rank needs a GPU of its own "
                               f"(torch symmetric memory refuses ranks on one device)")
        return IpcWindow(comm=comm, layout=layout)
    return SymmetricMemoryWindow(comm=comm, layout=layout)
