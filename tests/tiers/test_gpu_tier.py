"""The GPU tier beyond the shared tier contract (tests/tiers/test_tier_contract.py runs that on it).

The mappable-tier protocol (reserve, write, commit, locate) over both
mappable tiers; several device regions in one offset space; the same-host
handle exchange read by a real second process under a store lease;
demotion to RAM and promotion back with the bytes compared; tensors in and out. Device
memory here is the ``host`` stand-in; the device check
(benchmarks/gpu_check.py) runs this module with the cuda kind, so it
imports nothing beyond the tiers and the store (tests/tiers/test_gpu_settings.py
has the settings, the daemon and the client).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the GPU tier's tensors need torch (python tests/install.py installs the CPU build)")

from kvstore.block import BlockKey, BlockMeta, TierName, checksum
from kvstore.errors import BlockTooLarge, CorruptBlock, InvalidArgument, TierFull, TierUnavailable
from kvstore.store import StoreLimits, TieredStore
from kvstore.tiers import open_tier
from kvstore.tiers.device import attach_memory, known_kinds, open_memory
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.ram import HostRamTier
from tests.support.store_blocks import MiB, value

REPO = Path(__file__).resolve().parents[2]
# a child process imports this tree first, and keeps whatever else was on the path
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
GPU_MEMORY = os.environ.get("STRATA_TEST_GPU_MEMORY", "host")


def gpu(tmp_path, capacity=8 * MiB, devices=(0,)) -> GpuTier:
    options = {"shm_dir": str(tmp_path)} if GPU_MEMORY == "host" else {}
    return GpuTier(capacity, devices=devices, memory=GPU_MEMORY, **options)


def meta_of(data: bytes) -> BlockMeta:
    return BlockMeta(len(data), checksum(data))


def key(name: str) -> BlockKey:
    return BlockKey("m", name.encode())


@pytest.fixture(params=["gpu", "ram"])
def mappable(request, tmp_path):
    tier = gpu(tmp_path) if request.param == "gpu" else HostRamTier(8 * MiB, shm_dir=str(tmp_path), arena_name="a")
    yield tier
    tier.close()


# ---- the mappable protocol, on both mappable tiers ---------------------------------


def test_reserve_write_commit_locate(mappable):
    data = value(1, 100_000)
    offset = mappable.reserve(len(data))
    assert mappable.write_extent(offset, data) == checksum(data)
    assert mappable.commit(key("a"), offset, meta_of(data)) is True
    loc = mappable.locate(key("a"))
    assert loc == (offset, meta_of(data))
    with mappable.readable(loc[0], len(data)) as view:
        assert bytes(view) == data
    assert mappable.get(key("a")) == data


def test_commit_of_wrong_bytes_frees_the_extent(mappable):
    data = value(2, 50_000)
    offset = mappable.reserve(len(data))
    mappable.write_extent(offset, data)
    used = mappable.used_bytes
    with pytest.raises(CorruptBlock):
        mappable.commit(key("a"), offset, BlockMeta(len(data), checksum(data) ^ 1))
    assert mappable.used_bytes < used and not mappable.contains(key("a"))


def test_commit_of_a_present_key_and_unreserve_free(mappable):
    data = value(3, 8192)
    assert mappable.put(key("a"), data, meta_of(data))
    used = mappable.used_bytes
    offset = mappable.reserve(len(data))
    mappable.write_extent(offset, data)
    assert mappable.commit(key("a"), offset, meta_of(data)) is False
    assert mappable.used_bytes == used
    offset = mappable.reserve(4096)
    mappable.unreserve(offset)
    assert mappable.used_bytes == used
    with pytest.raises(ValueError, match="not a reserved extent"):
        mappable.unreserve(offset)


# ---- the GPU tier's own -------------------------------------------------------------


def test_regions_of_several_devices_share_one_offset_space(tmp_path):
    if GPU_MEMORY == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("one GPU here")
    tier = gpu(tmp_path, capacity=2 * MiB, devices=(0, 1))
    try:
        assert tier.capacity_bytes == 4 * MiB and len(tier.handles()) == 2
        with pytest.raises(BlockTooLarge, match="one device"):
            tier.reserve(3 * MiB)
        blocks = {f"k{i}": value(i, MiB) for i in range(4)}
        for name, data in blocks.items():
            assert tier.put(key(name), data, meta_of(data))
        regions = {tier.handle_of(tier.locate(key(n))[0])[0] for n in blocks}
        assert regions == {0, 1}, "new extents go to the device with the most room"
        for name, data in blocks.items():
            assert tier.get(key(name)) == data
    finally:
        tier.close()


def test_a_block_deleted_while_read_is_freed_by_its_reader(tmp_path):
    tier = gpu(tmp_path)
    try:
        data = value(4, MiB)
        tier.put(key("a"), data, meta_of(data))
        used = tier.used_bytes
        with tier._reading(key("a"), touch=False) as entry:
            assert tier.delete(key("a"))
            assert tier.used_bytes == used, "the extent is not handed out while its bytes are copied out"
            region, local = tier._region_of(entry[0])
            assert region.read(local, len(data))[0] == data
        assert tier.used_bytes == 0
    finally:
        tier.close()


def test_read_into_buffers_and_tensors(tmp_path):
    tier = gpu(tmp_path)
    try:
        data = value(5, 64 << 10)
        tier.put(key("a"), torch.frombuffer(bytearray(data), dtype=torch.float16), meta_of(data))
        out = bytearray(len(data))
        assert tier.read_into(key("a"), out) == meta_of(data) and out == data
        tensor = torch.empty(len(data) // 2, dtype=torch.float16)
        tier.read_into(key("a"), tensor)
        assert tensor.numpy().tobytes() == data
        with pytest.raises(InvalidArgument, match="the buffer holds"):
            tier.read_into(key("a"), bytearray(len(data) - 1))
        with pytest.raises(InvalidArgument, match="not contiguous"):
            tier.put(key("b"), torch.zeros(64, 64)[:, ::2], BlockMeta(8192, 0))
        assert tier.read_into(key("missing"), out) is None
    finally:
        tier.close()


@pytest.mark.skipif(GPU_MEMORY != "cuda", reason="device tensors need the cuda kind")
def test_device_and_pinned_tensors_in_and_out(tmp_path):
    tier = gpu(tmp_path)
    try:
        data = value(7, 3 * MiB + 4096)
        src = torch.frombuffer(bytearray(data), dtype=torch.uint8).cuda()
        assert tier.put(key("dev"), src, meta_of(data))
        dst = torch.zeros_like(src)
        assert tier.read_into(key("dev"), dst) == meta_of(data)
        assert torch.equal(dst, src)
        pinned = torch.empty(len(data), dtype=torch.uint8).pin_memory()
        tier.read_into(key("dev"), pinned)
        assert pinned.numpy().tobytes() == data
        assert tier.put(key("pinned"), pinned, meta_of(data))
        assert tier.get(key("pinned")) == data
        with pytest.raises(CorruptBlock):
            tier.put(key("bad"), src, BlockMeta(len(data), checksum(data) ^ 1))
        assert not tier.contains(key("bad"))
    finally:
        tier.close()


def test_a_corrupted_byte_in_device_memory_is_never_handed_out(tmp_path):
    tier = gpu(tmp_path)
    store = TieredStore([tier, HostRamTier(16 * MiB, shm_dir=str(tmp_path), arena_name="r")],
                        limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0))
    try:
        for name in ("a", "b"):
            data = value(ord(name), MiB)
            store.put(key(name), data, meta_of(data))
        for name in ("a", "b"):
            region, local = tier._region_of(tier.locate(key(name))[0])
            region.write(local + 4096, b"\xff" * 16)  # a bit flip the tier did not make
        with pytest.raises(CorruptBlock):
            tier.get(key("a"))
        assert not tier.contains(key("a")), "the corrupt block was dropped"
        with pytest.raises(CorruptBlock):
            store.get(key("b"))
        assert store.get(key("b")) is None and not tier.contains(key("b"))
        assert tier.used_bytes == 0
    finally:
        store.close()


def test_concurrent_puts_reads_and_deletes_keep_accounting(tmp_path):
    import threading

    tier = gpu(tmp_path, capacity=8 * MiB)
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(40):
                name, data = f"w{n}-{i % 5}", value(n * 100 + i % 5, 256 << 10)
                try:
                    tier.put(key(name), data, meta_of(data))
                except TierFull:  # under contention an answer, not a fault
                    pass
                got = tier.get(key(name))
                assert got is None or got == data
                if i % 3 == 0:
                    tier.delete(key(name))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        stats = tier.stats()
        assert stats.used_bytes == stats.blocks * (256 << 10) and tier.held_bytes == 0
        for name in list(tier.lru()):
            tier.delete(name)
        assert tier.used_bytes == 0
    finally:
        tier.close()


def test_a_head_without_host_view_takes_streamed_writes_and_slots(tmp_path):
    """Device memory has no host view: streamed writes are buffered and copied in, slots are verified
    through the tier (the host stand-in refuses views here, as cuda memory does)."""
    options = {"shm_dir": str(tmp_path), "addressable": False} if GPU_MEMORY == "host" else {}
    tier = GpuTier(4 * MiB, memory=GPU_MEMORY, **options)
    store = TieredStore([tier, HostRamTier(16 * MiB, shm_dir=str(tmp_path), arena_name="r")],
                        limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0))
    try:
        assert not tier.host_addressable
        with pytest.raises(TierUnavailable, match="not addressable from the host"):
            tier.view(0, 4096)
        data = value(8, MiB + 100)
        writer = store.open_write(key("streamed"), meta_of(data))
        assert not writer.in_place
        for at in range(0, len(data), 64 << 10):
            writer.write(data[at:at + (64 << 10)])
        assert writer.commit(None) == (True, TierName.GPU)
        assert store.get(key("streamed"))[0] == data
        slot_data = value(9, 300_000)
        [good, bad] = store.allocate("m", [(b"slot", len(slot_data), None, ""), (b"bad", len(slot_data), None, "")])
        tier.write_extent(good.offset, slot_data)
        tier.write_extent(bad.offset, slot_data)
        assert [r[1] for r in store.commit([(good.slot_id, checksum(slot_data))])] == [True]
        with pytest.raises(CorruptBlock):
            store.commit([(bad.slot_id, checksum(slot_data) ^ 1)])
        assert store.get(key("slot"))[0] == slot_data and store.get(key("bad")) is None
    finally:
        store.close()


def test_memory_kinds_registry_and_bounds(tmp_path):
    assert known_kinds() == ["cuda", "host"]
    with pytest.raises(InvalidArgument, match="known kinds are cuda, host"):
        open_memory("tpu", MiB)
    region = open_memory("host", MiB, shm_dir=str(tmp_path))
    try:
        with pytest.raises(InvalidArgument, match="leave the"):
            region.write(MiB - 10, b"x" * 11)
        with pytest.raises(InvalidArgument, match="leave the"):
            region.read_into(-1, bytearray(4))
    finally:
        region.close()
    assert not list(tmp_path.iterdir()), "a closed region leaves no file"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_memory_without_cuda_names_the_fix():
    with pytest.raises(TierUnavailable, match=r"CUDA is not available.*--gpu-bytes 0"):
        open_memory("cuda", MiB)
    with pytest.raises(TierUnavailable, match="CUDA is not available"):
        open_tier("gpu", capacity_bytes=MiB, devices=(0,), memory="cuda")


# ---- the same-host exchange: a second process reads under the store's lease ----------

READER = """
import pickle, sys
from kvstore.tiers.device import attach_memory
handle, offset, size = pickle.loads(bytes.fromhex(sys.stdin.read()))
region = attach_memory(handle)
data, got = region.read(offset, size)
region.close()
sys.stdout.write(f"{got} {data.hex()}")
"""


@pytest.mark.system
def test_another_process_reads_a_leased_block_through_the_handle(tmp_path):
    tier = gpu(tmp_path, capacity=4 * MiB)
    store = TieredStore([tier, HostRamTier(16 * MiB, shm_dir=str(tmp_path), arena_name="r")],
                        limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0))
    try:
        data = value(6, 256 << 10)
        assert store.put(key("a"), data, meta_of(data)) == (True, TierName.GPU)
        [loc] = store.lookup("m", [b"a"], lease_s=30)
        assert loc.tier is TierName.GPU and loc.lease_id
        for i in range(8):  # pressure: unleased blocks go down to RAM, the leased one stays where it was
            store.put(key(f"k{i}"), value(i, MiB), meta_of(value(i, MiB)))
        store.flush_demotions()
        assert tier.locate(key("a"))[0] == loc.offset
        index, local = tier.handle_of(loc.offset)
        ticket = pickle.dumps((tier.handles()[index], local, loc.meta.size)).hex()
        out = subprocess.run([sys.executable, "-c", READER], input=ticket, capture_output=True, text=True,
                             env=CHILD_ENV, check=True, timeout=120).stdout
        got, hexdata = out.split()
        assert int(got) == loc.meta.checksum and bytes.fromhex(hexdata) == data
        assert store.release([loc.lease_id]) == [True]
    finally:
        store.close()


def test_attached_region_is_refused_after_the_owner_restarts(tmp_path):
    if GPU_MEMORY != "host":
        pytest.skip("the host stand-in's token check")
    first = open_memory("host", MiB, shm_dir=str(tmp_path), name="strata-gpu-x")
    handle = first.handle()
    first.close()
    second = open_memory("host", MiB, shm_dir=str(tmp_path), name="strata-gpu-x")
    try:
        with pytest.raises(Exception, match="token"):
            attach_memory(handle)
    finally:
        second.close()


# ---- demotion to RAM and promotion back, bytes compared -------------------------------


def test_demotion_to_ram_and_promotion_back_keep_every_byte(tmp_path):
    tier = gpu(tmp_path, capacity=4 * MiB)
    store = TieredStore([tier, HostRamTier(32 * MiB, shm_dir=str(tmp_path), arena_name="r")],
                        limits=StoreLimits.from_settings(max_block_bytes=2 * MiB, demotion_threads=0))
    try:
        blocks = {f"k{i}": value(i, MiB) for i in range(12)}
        for name, data in blocks.items():
            assert store.put(key(name), data, meta_of(data))[1] is TierName.GPU
        store.flush_demotions()
        assert tier.stats().blocks <= 4
        assert store.exists("m", [b"k0"]) == [TierName.HOST], "the oldest went down to RAM"
        data, _, found = store.get(key("k0"))
        assert data == blocks["k0"] and found is TierName.HOST
        assert tier.contains(key("k0")), "a read from RAM is promoted into the gpu tier"
        for name, data in blocks.items():
            assert store.get(key(name))[0] == data
            store.flush_demotions()
    finally:
        store.close()
