"""Caller buffers as bytes: plain buffers, and torch tensors on the host or a device.

Callers hand the GPU tier and the client either a buffer (``bytes``,
``bytearray``, ``memoryview``, a NumPy array) or a torch tensor. A tensor is
taken as its raw bytes (``view(torch.uint8)`` of a contiguous tensor: a KV
block's dtype and shape travel in the block's ``layout``, not here). torch is
imported only when a tensor is actually passed, so nothing here needs it.
"""

from __future__ import annotations

import sys

from kvstore.errors import InvalidArgument


def is_tensor(obj) -> bool:
    """Whether ``obj`` is a torch tensor, without importing torch when the caller never did."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def tensor_device(obj) -> str:
    """``cpu``, ``cuda:N``: where a tensor's bytes live; ``cpu`` for every other buffer."""
    return str(obj.device) if is_tensor(obj) else "cpu"


def tensor_bytes(tensor):
    """The tensor's bytes as a flat uint8 tensor on its own device (no copy); it must be contiguous,
    because a block is one run of bytes and a strided tensor would silently read someone else's."""
    import torch

    if not tensor.is_contiguous():
        raise InvalidArgument(
            f"a {tuple(tensor.shape)} tensor with strides {tensor.stride()} is not contiguous: pass "
            "tensor.contiguous(), or a view of one block's bytes"
        )
    return tensor.detach().reshape(-1).view(torch.uint8)


def host_view(buf, *, writable: bool = False) -> memoryview:
    """A flat byte view of a host buffer or a CPU tensor (no copy)."""
    if is_tensor(buf):
        if buf.device.type != "cpu":
            raise InvalidArgument(f"a tensor on {buf.device} has no host view: stage it through host memory")
        buf = tensor_bytes(buf).numpy()
    try:
        view = memoryview(buf)
    except TypeError:
        raise InvalidArgument(f"a {type(buf).__name__} is not a buffer: pass bytes, a bytearray, a memoryview, "
                              "a NumPy array or a torch tensor") from None
    if not view.contiguous:
        raise InvalidArgument("the buffer is not contiguous: pass one run of bytes")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if writable and view.readonly:
        raise InvalidArgument("the buffer is read-only: pass a bytearray, a writable array or a tensor")
    return view


def nbytes(buf) -> int:
    if is_tensor(buf):
        return buf.numel() * buf.element_size()
    return host_view(buf).nbytes
