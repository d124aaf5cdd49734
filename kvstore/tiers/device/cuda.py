"""``cuda`` device memory: one allocation per device through torch, pinned staging, CUDA IPC.

Why one big tensor per device: the region is allocated once at start and
carved by the tier's own extent allocator (as the host arena is), so blocks
never go through torch's caching allocator one by one, never fragment it,
and one CUDA IPC handle covers every block a reader may lease.

Why pinned staging buffers: a copy from pageable host memory is staged by
the driver anyway, synchronously; copying through our own page-locked
buffers lets the host-side work (the memcpy into staging and the checksum of
the bytes, which is where a block is verified as it crosses) of chunk *i*
overlap the DMA of chunk *i−1* on a side stream. ``STAGING_BUFFERS``
buffers of ``STAGING_BYTES`` per direction, each with an event that says
when the DMA using it is done, bound the memory pinned. A caller whose
buffer is already page-locked (a pinned torch tensor: an engine's or
LMCache's host buffers) skips staging: one DMA straight from it, hashed on
the host while the DMA runs, and chunked DMAs straight into it on the way
out, each chunk hashed as soon as it lands.

Checksums are computed on the host side of each copy (xxh3, as on every
other hop). A copy that stays in device memory (into or out of a caller's
CUDA tensor on the same device) is verified on the way in, so a read into a
CUDA tensor returns ``None`` for its checksum instead of paying a
device-to-host pass: those bytes never left device memory since they were
verified. A write from a CUDA tensor is hashed through the staging
buffers: the bytes are new to the tier and their checksum is the contract.

IPC: :meth:`CudaMemory.handle` is the region's ``torch.multiprocessing``
reduction (``storage._share_cuda_()``: the allocation's cudaIpcMemHandle,
its offset, and torch's cross-process reference counter), and
:class:`AttachedCudaMemory` rebuilds the tensor with
``rebuild_cuda_tensor`` in the reading process: the reader copies from the
owner's memory directly, device to device.
"""

from __future__ import annotations

import threading

import xxhash

from kvstore.block import COPY_CHUNK
from kvstore.errors import InvalidArgument, TierUnavailable
from kvstore.tiers.device.base import AttachedMemory, DeviceMemory, MemoryHandle
from kvstore.tiers.device.buffers import host_view, is_tensor, tensor_bytes

STAGING_BYTES = 8 << 20
STAGING_BUFFERS = 3


def _torch_cuda(device: int):
    """torch, with CUDA usable on ``device``; TierUnavailable naming the fix otherwise."""
    try:
        import torch
    except ImportError:
        raise TierUnavailable(
            "the gpu tier needs torch with CUDA (pip install torch, a CUDA build); or leave it out: "
            "--gpu-bytes 0"
        ) from None
    if not torch.cuda.is_available():
        raise TierUnavailable(
            f"the gpu tier is configured (--gpu-bytes) but CUDA is not available here (torch {torch.__version__}, "
            f"{'a CPU-only build' if torch.version.cuda is None else 'no usable GPU or driver'}): run on a node "
            "with an NVIDIA GPU and a CUDA build of torch, or set --gpu-bytes 0"
        )
    count = torch.cuda.device_count()
    if not 0 <= device < count:
        raise TierUnavailable(f"--gpu-devices names device {device}, but this node has {count} (0..{count - 1})")
    return torch


def probe(devices: list[int]) -> None:
    for device in devices:
        _torch_cuda(device)


class _Copier:
    """Chunked, overlapped copies between one device region and the host, in one direction each."""

    def __init__(self, torch, region, device: int, staging_bytes: int, buffers: int) -> None:
        self._torch = torch
        self._region = region
        self._device = torch.device("cuda", device)
        self._chunk = staging_bytes
        self._lanes = {}
        for direction in ("in", "out"):
            stream = torch.cuda.Stream(device=self._device)
            staging = [torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(buffers)]
            events = [torch.cuda.Event() for _ in range(buffers)]
            self._lanes[direction] = (threading.Lock(), stream, staging, [s.numpy() for s in staging], events)

    def write_host(self, offset: int, src: memoryview) -> int:
        lock, stream, staging, hosts, events = self._lanes["in"]
        h = xxhash.xxh3_64()
        with lock, self._torch.cuda.stream(stream):
            pending = [False] * len(staging)
            for i, at in enumerate(range(0, len(src), self._chunk)):
                lane = i % len(staging)
                if pending[lane]:
                    events[lane].synchronize()  # the DMA that last used this buffer is done
                n = min(self._chunk, len(src) - at)
                buf = memoryview(hosts[lane])
                for sub in range(0, n, COPY_CHUNK):  # copy, then hash from cache
                    end = min(sub + COPY_CHUNK, n)
                    buf[sub:end] = src[at + sub:at + end]
                    h.update(buf[sub:end])
                self._region[offset + at:offset + at + n].copy_(staging[lane][:n], non_blocking=True)
                events[lane].record(stream)
                pending[lane] = True
            stream.synchronize()
        return h.intdigest()

    def read_host(self, offset: int, size: int, dst: memoryview | None) -> int:
        """Copy out ``size`` bytes into ``dst`` (or only hash them when ``dst`` is None); their checksum."""
        lock, stream, staging, hosts, events = self._lanes["out"]
        h = xxhash.xxh3_64()
        chunks = [(at, min(self._chunk, size - at)) for at in range(0, size, self._chunk)]
        with lock, self._torch.cuda.stream(stream):
            ahead = len(staging)
            for i, (at, n) in enumerate(chunks[:ahead]):
                staging[i][:n].copy_(self._region[offset + at:offset + at + n], non_blocking=True)
                events[i].record(stream)
            for i, (at, n) in enumerate(chunks):
                lane = i % len(staging)
                events[lane].synchronize()
                buf = memoryview(hosts[lane])[:n]
                if dst is None:
                    h.update(buf)
                else:
                    for sub in range(0, n, COPY_CHUNK):
                        end = min(sub + COPY_CHUNK, n)
                        dst[at + sub:at + end] = buf[sub:end]
                        h.update(buf[sub:end])
                nxt = i + ahead
                if nxt < len(chunks):  # this buffer is free again: start the DMA of a later chunk into it
                    nat, nn = chunks[nxt]
                    staging[lane][:nn].copy_(self._region[offset + nat:offset + nat + nn], non_blocking=True)
                    events[lane].record(stream)
        return h.intdigest()

    def write_pinned(self, offset: int, src) -> int:
        """From a page-locked host tensor: one DMA straight from it, hashed on the host while it runs."""
        lock, stream, _, _, _ = self._lanes["in"]
        h = xxhash.xxh3_64()
        with lock, self._torch.cuda.stream(stream):
            self._region[offset:offset + src.numel()].copy_(src, non_blocking=True)
            view = memoryview(src.numpy())
            for at in range(0, len(view), COPY_CHUNK):
                h.update(view[at:at + COPY_CHUNK])
            stream.synchronize()
        return h.intdigest()

    def read_pinned(self, offset: int, dst) -> int:
        """Into a page-locked host tensor: DMA chunk by chunk straight into it, hashing each landed chunk
        while the next one is copied."""
        lock, stream, _, _, events = self._lanes["out"]
        h = xxhash.xxh3_64()
        view = memoryview(dst.numpy())
        size = dst.numel()
        chunks = [(at, min(self._chunk, size - at)) for at in range(0, size, self._chunk)]
        with lock, self._torch.cuda.stream(stream):
            for i, (at, n) in enumerate(chunks):
                dst[at:at + n].copy_(self._region[offset + at:offset + at + n], non_blocking=True)
                events[i % len(events)].record(stream)
                if i >= len(events) - 1:  # keep len(events) DMAs in flight, hash the oldest landed
                    j = i - len(events) + 1
                    events[j % len(events)].synchronize()
                    h.update(view[chunks[j][0]:chunks[j][0] + chunks[j][1]])
            for j in range(max(len(chunks) - len(events) + 1, 0), len(chunks)):
                events[j % len(events)].synchronize()
                h.update(view[chunks[j][0]:chunks[j][0] + chunks[j][1]])
        return h.intdigest()

    def device_copy(self, dst, src, direction: str) -> None:
        """A copy between the region and a caller's CUDA tensor, ordered after the caller's pending work."""
        _, stream, _, _, _ = self._lanes[direction]
        stream.wait_stream(self._torch.cuda.current_stream(self._device))
        with self._torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()


def _pinned_tensor(buf) -> bool:
    return is_tensor(buf) and buf.device.type == "cpu" and buf.is_pinned() and buf.is_contiguous()


def _device_tensor(buf, device) -> bool:
    if not is_tensor(buf) or buf.device.type == "cpu":
        return False
    if buf.device != device:
        raise InvalidArgument(f"a tensor on {buf.device} cannot be copied to or from the region on {device}: "
                              "move it to that device, or pass a host buffer")
    return True


class _CudaRegion:
    """What the owner and an attached reader share: the region tensor and its copier."""

    kind = "cuda"

    def _start(self, torch, region, device: int, staging_bytes: int, buffers: int) -> None:
        self._torch = torch
        self._region = region
        self._dev = torch.device("cuda", device)
        self.device = str(self._dev)
        self._copier = _Copier(torch, region, device, staging_bytes, buffers)

    @property
    def size(self) -> int:
        return self._region.numel()

    def read_into(self, offset: int, dst) -> int | None:
        if _device_tensor(dst, self._dev):
            out = tensor_bytes(dst)
            self._check(offset, out.numel())
            self._copier.device_copy(out, self._region[offset:offset + out.numel()], "out")
            return None  # stayed in device memory: verified when it came in
        if _pinned_tensor(dst):
            out = tensor_bytes(dst)
            self._check(offset, out.numel())
            return self._copier.read_pinned(offset, out)
        out = host_view(dst, writable=True)
        self._check(offset, len(out))
        return self._copier.read_host(offset, len(out), out)

    def write(self, offset: int, src) -> int:
        if _device_tensor(src, self._dev):
            data = tensor_bytes(src)
            self._check(offset, data.numel())
            dst = self._region[offset:offset + data.numel()]
            self._copier.device_copy(dst, data, "in")
            return self._copier.read_host(offset, data.numel(), None)  # new bytes: hashed on the host side
        if _pinned_tensor(src):
            data = tensor_bytes(src)
            self._check(offset, data.numel())
            return self._copier.write_pinned(offset, data)
        data = host_view(src)
        self._check(offset, len(data))
        return self._copier.write_host(offset, data)

    def tensor(self, offset: int, size: int):
        """A uint8 tensor over ``size`` bytes of the region (no copy), for kernels that read in place."""
        self._check(offset, size)
        return self._region[offset:offset + size]


class CudaMemory(_CudaRegion, DeviceMemory):
    def __init__(self, size: int, device: int = 0, *, staging_bytes: int = STAGING_BYTES,
                 staging_buffers: int = STAGING_BUFFERS) -> None:
        torch = _torch_cuda(device)
        try:
            region = torch.empty(size, dtype=torch.uint8, device=torch.device("cuda", device))
        except torch.cuda.OutOfMemoryError as err:
            free, total = torch.cuda.mem_get_info(device)
            raise TierUnavailable(
                f"cannot allocate the gpu tier's {size} bytes on cuda:{device} ({free} of {total} bytes free): "
                "lower --gpu-bytes, or leave room beside the engines"
            ) from err
        self._start(torch, region, device, staging_bytes, staging_buffers)
        self._handle: MemoryHandle | None = None

    def checksum(self, offset: int, size: int) -> int:
        self._check(offset, size)
        return self._copier.read_host(offset, size, None)

    def handle(self) -> MemoryHandle:
        """The reduction's arguments that are plain values (bytes, ints, bools, the shape), so the handle
        crosses the same-host socket as msgpack; the types it also names are always the same here."""
        if self._handle is None:
            from torch.multiprocessing.reductions import reduce_tensor

            _, args = reduce_tensor(self._region)
            (_, shape, stride, offset, _, _, *rest) = args
            self._handle = MemoryHandle(self.kind, self.device, self.size, (list(shape), list(stride), offset, *rest))
        return self._handle

    def close(self) -> None:
        self._torch.cuda.synchronize(self._dev)
        self._region = None
        self._copier = None


class AttachedCudaMemory(_CudaRegion, AttachedMemory):
    def __init__(self, handle: MemoryHandle, *, staging_bytes: int = STAGING_BYTES,
                 staging_buffers: int = STAGING_BUFFERS) -> None:
        device = int(handle.device.partition(":")[2] or 0)
        torch = _torch_cuda(device)
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        shape, stride, offset, *rest = handle.payload
        region = rebuild_cuda_tensor(torch.Tensor, torch.Size(shape), tuple(stride), offset,
                                     torch.storage.TypedStorage, torch.uint8, *rest)
        if region.numel() != handle.size:
            raise InvalidArgument(f"the handle maps {region.numel()} bytes but says {handle.size}")
        self._start(torch, region, device, staging_bytes, staging_buffers)

    def close(self) -> None:
        self._region = None
        self._copier = None
