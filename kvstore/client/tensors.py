"""Tensors as block bytes for the client: put from a tensor, ``get_into`` a tensor.

A tensor on the host is read or written in place (its bytes, no copy). A
tensor on a GPU goes through host staging: ``put`` copies it device to host
into page-locked memory first, ``get_into`` reads the block into a
page-locked staging buffer and copies it up into the tensor once the read
is verified, so a torn or corrupt read never reaches the engine's memory.
That is the fallback for every tier and every transport; a reader on the
node of a daemon's GPU tier copies device to device instead
(:meth:`kvstore.tiers.gpu.GpuTier.read_into`, :mod:`kvstore.tiers.device`).

torch is imported only when a tensor is passed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import replace

from kvstore.errors import InvalidArgument
from kvstore.tiers.device.buffers import host_view, is_tensor, nbytes, tensor_bytes
from kvstore.transport.base import Block, BlockPut, fit


def _on_device(buf) -> bool:
    return is_tensor(buf) and buf.device.type != "cpu"


def staged(tensor) -> memoryview:
    """A tensor's bytes on the host: in place for a CPU tensor, a page-locked copy for a device tensor."""
    if not _on_device(tensor):
        return host_view(tensor)
    import torch

    out = torch.empty(nbytes(tensor), dtype=torch.uint8, pin_memory=True)
    out.copy_(tensor_bytes(tensor))
    return memoryview(out.numpy())


def host_puts(items: Sequence[BlockPut]) -> list[BlockPut]:
    """``items`` with every tensor value replaced by its bytes on the host."""
    return [replace(item, value=staged(item.value)) if is_tensor(item.value) else item for item in items]


async def host_puts_async(items: Sequence[BlockPut]) -> list[BlockPut]:
    """:func:`host_puts` for the event loop: device-to-host copies run in a worker thread."""
    if any(_on_device(item.value) for item in items):
        return await asyncio.to_thread(host_puts, items)
    return host_puts(items)


def any_on_device(buffers) -> bool:
    return any(_on_device(b) for b in buffers)


def device_placement(keys: Sequence[bytes], buffers: Sequence):
    """``get_into``'s buffers for a transport that reads a gpu tier's blocks into CUDA tensors device to
    device (``Transport.device_tensors``): tensors on a device as they are, every other buffer as a
    writable host view. The transport stages the blocks it reads from elsewhere through host memory."""
    if len(buffers) != len(keys):
        raise InvalidArgument(f"{len(keys)} keys but {len(buffers)} buffers: pass one buffer per key")
    views = [b if b is None or _on_device(b) else host_view(b, writable=True) for b in buffers]

    def place(i: int, info):
        view = views[i]
        return view if view is None or _on_device(view) else fit(info.key, info.size, view)

    return place


class StagedBuffers:
    """``get_into``'s buffers (a sequence or a placement function) with tensors made host buffers.

    :meth:`finish` copies each found block's staged bytes up into its device tensor and points
    the returned ``Block.data`` at the tensor's bytes.
    """

    def __init__(self, buffers) -> None:
        self._device: dict[int, tuple[object, object]] = {}  # index -> (device tensor, pinned staging)
        if callable(buffers):
            self.buffers = lambda i, info: self._host(i, buffers(i, info))
        else:
            self.buffers = [self._host(i, buf) for i, buf in enumerate(buffers)]

    def _host(self, i: int, buf):
        if buf is None or not is_tensor(buf):
            return buf
        if not _on_device(buf):
            return host_view(buf, writable=True)
        known = self._device.get(i)
        if known is not None and known[0] is buf:  # a retried read places the same buffer again
            return memoryview(known[1].numpy())
        import torch

        pinned = torch.empty(nbytes(buf), dtype=torch.uint8, pin_memory=True)
        self._device[i] = (buf, pinned)
        return memoryview(pinned.numpy())

    async def finish_async(self, blocks: list[Block | None]) -> list[Block | None]:
        """:meth:`finish` for the event loop: host-to-device copies run in a worker thread."""
        if self._device:
            return await asyncio.to_thread(self.finish, blocks)
        return blocks

    def finish(self, blocks: list[Block | None]) -> list[Block | None]:
        out = list(blocks)
        for i, (tensor, pinned) in self._device.items():
            block = out[i]
            if block is None:
                continue
            size = len(block.data)
            dst = tensor_bytes(tensor)[:size]
            dst.copy_(pinned[:size])
            out[i] = replace(block, data=dst)
        return out
