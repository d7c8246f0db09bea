"""Transports: how completed chunks reach their owner (``dma``: a copier; ``lsa``: direct stores)."""

from cco.transport.base import Drop, FaultPlan, Transport
from cco.transport.protocol import (CommTimeoutError, Deadline, PeerMismatchError, PeerRejectedError,
                                    SelfTestError, TransferError)


def transport_class(name: str) -> type[Transport]:
    """The CPU transport class of ``name`` ("dma" | "lsa")."""
    if name == "dma":
        from cco.transport.dma import DmaTransport
        return DmaTransport
    if name == "lsa":
        from cco.transport.lsa import LsaTransport
        return LsaTransport
    raise ValueError(f"transport={name!r} is not supported; pass 'dma' or 'lsa'")


__all__ = ["CommTimeoutError", "Deadline", "Drop", "FaultPlan", "PeerMismatchError", "PeerRejectedError",
           "SelfTestError", "TransferError", "Transport", "transport_class"]
