"""The host's side of a daemon's settings: the arena's tmpfs, the disk tier's filesystem, memory.

Each check reads what ``strata serve`` would find with the same settings,
without creating anything: the arena is a sparse file, so a tmpfs too small
for it is found only when a page fault hits the full filesystem (SIGBUS: the
daemon dies), and a disk tier on a small filesystem is quietly bounded to
what it holds. Shared-memory pages count against the memory limit of the
cgroup that first touches them, so a container whose limit is below the
arena is OOM-killed once the cache fills.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.config import Settings
from kvstore.config.tiers import arena_name
from kvstore.doctor.report import Finding, fail, ok, size, skip, warn
from kvstore.shm.arena import HEADER_BYTES as ARENA_HEADER_BYTES
from kvstore.shm.table import UNIT_BYTES, max_table_units, table_units

PAGE_BYTES = 4096
PROCESS_HEADROOM_BYTES = 512 << 20  # the daemon's own heap, threads and buffers beside the arena
POD_MEMORY_STEP_BYTES = 256 << 20  # a pod's memory request is rounded up to this
MAX_FILES_COUNTED = 1_000_000  # a limit on the walk over the disk tier's files
MEMORY_FS = {"tmpfs", "ramfs"}
CONTAINER_LAYER_FS = {"overlay", "aufs"}


@dataclass(frozen=True)
class Host:
    """Where the checks read the host from: the real paths by default, others in tests; and
    what the command line names that the settings do not (yet): an S3 endpoint."""

    mountinfo: Path = Path("/proc/self/mountinfo")
    proc_cgroup: Path = Path("/proc/self/cgroup")
    cgroup_root: Path = Path("/sys/fs/cgroup")
    environ: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 2.0
    s3_endpoint: str = ""


@dataclass(frozen=True)
class Mount:
    point: str
    fstype: str


def mount_of(path: Path, mountinfo: Path) -> Mount | None:
    """The mount holding ``path`` (the longest mount point that is a prefix of it)."""
    best: Mount | None = None
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return None
    target = str(path)
    for line in lines:
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = fields[4].encode().decode("unicode_escape")  # \040 for a space
        fstype = line.split(" - ", 1)[1].split()[0]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best.point)):
            best = Mount(point, fstype)
    return best


def existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def state_dir(settings: Settings) -> Path:
    """The daemon's cache directory, as ``Daemon`` resolves it (it names the arena files)."""
    return Path(settings.tiers.disk.dir).expanduser().resolve()


# ---- the arena's tmpfs --------------------------------------------------------------------


def arena_bytes(settings: Settings) -> int:
    """Every arena's file: its blocks (``ram_bytes``) and its header."""
    plan = settings.arena_plan()
    return sum(a["ram_bytes"] for a in plan) + ARENA_HEADER_BYTES * len(plan)


def table_bytes(settings: Settings, worst: bool = False) -> int:
    """The arenas' block tables as they start (a unit per arena page: 1/16 of the arena), or at
    their worst-case growth. The table grows with long keys and layouts, while the tmpfs keeps room
    for the arena's unwritten pages; beyond that a put is refused, never lost."""
    if not settings.tiers.ram.crash_safe:
        return 0
    units = max_table_units if worst else table_units
    return sum(units(a["ram_bytes"], PAGE_BYTES) for a in settings.arena_plan()) * UNIT_BYTES


def memory_needed(settings: Settings) -> int:
    """What a daemon with these settings holds in memory once its cache is full: the arenas and
    their block tables (tmpfs pages count against the cgroup that first touches them) and the
    daemon's own heap, threads and buffers (``PROCESS_HEADROOM_BYTES``)."""
    return arena_bytes(settings) + table_bytes(settings) + PROCESS_HEADROOM_BYTES


def pod_memory_bytes(settings: Settings) -> int:
    """The daemon container's memory request and limit: :func:`memory_needed` rounded up to
    ``POD_MEMORY_STEP_BYTES``. Request equal to limit, so the pod is Guaranteed and the kubelet
    evicts it after the pods that use more than they asked."""
    step = POD_MEMORY_STEP_BYTES
    return -(-memory_needed(settings) // step) * step


def check_shm(settings: Settings, host: Host) -> list[Finding]:
    ram = settings.tiers.ram
    directory = Path(ram.shm_dir).expanduser()
    arena = arena_bytes(settings)
    table, table_most = table_bytes(settings), table_bytes(settings, worst=True)
    if not directory.is_dir():
        return [fail("shm", f"--shm-dir {directory} does not exist",
                     f"create it on a tmpfs of at least {size(arena + table)}, or point --shm-dir at "
                     "one (in Kubernetes: an emptyDir with medium: Memory, or a hostPath under the node's /dev/shm)")]
    if not os.access(directory, os.W_OK | os.X_OK):
        return [fail("shm", f"--shm-dir {directory} is not writable by uid {os.getuid()}",
                     "give the daemon's user the directory (chown), or run the daemon as its owner")]
    st = os.statvfs(directory)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    prefix = arena_name(state_dir(settings))
    reused = sum(p.stat().st_blocks * 512 for p in directory.glob(prefix + "*") if p.is_file())
    available = free + reused
    mount = mount_of(directory.resolve(), host.mountinfo)
    fstype = mount.fstype if mount else "unknown"
    findings = []
    where = f"--shm-dir {directory} ({fstype}, {size(total)}, {size(free)} free"
    where += f", {size(reused)} held by this node's arena)" if reused else ")"
    need = f"the arena needs {size(arena)}" + (
        f" and its block table {size(table)} (growing with long keys and layouts, up to {size(table_most)} "
        "at worst, as the tmpfs allows: beyond it a put is refused)" if table else "")
    grow = (f"give {directory} at least {size(arena + table)}: in Kubernetes an emptyDir "
            f"{{medium: Memory, sizeLimit: {size(arena + table)}}}, or the node's /dev/shm "
            "(mount -o remount,size=... /dev/shm) for a hostPath; docker run --shm-size; or lower --ram-bytes")
    if available < arena:
        findings.append(fail("shm", f"{where}: {need}; a page fault past the end of the filesystem kills the "
                                    "daemon (SIGBUS)", grow))
    elif available < arena + table:
        findings.append(warn("shm", f"{where}: {need}; it fits only while blocks are large", grow))
    else:
        findings.append(ok("shm", f"{where}: {need}"))
    if fstype not in MEMORY_FS and mount is not None:
        findings.append(warn("shm", f"--shm-dir {directory} is on {fstype}, not a tmpfs: the arena's pages are "
                                    "written back to a device",
                             "point --shm-dir at a tmpfs (/dev/shm, or an emptyDir with medium: Memory)"))
    return findings


# ---- memory limit -------------------------------------------------------------------------


def memory_limit(host: Host) -> tuple[int | None, str]:
    """This process's cgroup memory limit (None: unlimited) and the file it came from."""
    candidates = []
    try:
        for line in host.proc_cgroup.read_text().splitlines():
            hierarchy, _, rest = line.partition(":")
            controllers, _, path = rest.partition(":")
            if hierarchy == "0" and controllers == "":
                candidates.append(host.cgroup_root / path.lstrip("/") / "memory.max")
            elif "memory" in controllers.split(","):
                candidates.append(host.cgroup_root / "memory" / path.lstrip("/") / "memory.limit_in_bytes")
    except OSError:
        pass
    candidates += [host.cgroup_root / "memory.max", host.cgroup_root / "memory" / "memory.limit_in_bytes"]
    for path in candidates:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text == "max" or (text.isdigit() and int(text) >= 1 << 62):  # cgroup v1 says "unlimited" with a huge number
            return None, str(path)
        if text.isdigit():
            return int(text), str(path)
    return None, ""


def check_memory(settings: Settings, host: Host) -> list[Finding]:
    limit, source = memory_limit(host)
    arena, table = arena_bytes(settings), table_bytes(settings)
    need = memory_needed(settings)
    if not source:
        return [skip("memory", "no cgroup memory limit could be read")]
    if limit is None:
        return [ok("memory", f"no memory limit ({source}); the arena takes {size(arena)} of the host's memory")]
    summary = (f"memory limit {size(limit)} ({source}); the arena's pages ({size(arena)}) and its block table's "
               f"({size(table)}) count against it, plus about {size(PROCESS_HEADROOM_BYTES)} for the daemon itself")
    if limit < need:
        return [fail("memory", summary + ": the daemon is OOM-killed once the cache fills",
                     f"give the container {size(pod_memory_bytes(settings))} "
                     "(resources.requests.memory and limits.memory), or lower --ram-bytes")]
    return [ok("memory", summary)]


# ---- the disk tier ------------------------------------------------------------------------


def _held_bytes(directory: Path) -> int:
    """Bytes the disk tier's files already take (what a restart keeps), at most MAX_FILES_COUNTED files."""
    held, seen = 0, 0
    for sub in ("blocks", "arenas"):
        for root, _, files in os.walk(directory / sub):
            for name in files:
                seen += 1
                if seen > MAX_FILES_COUNTED:
                    return held
                try:
                    held += os.stat(os.path.join(root, name)).st_blocks * 512
                except OSError:
                    continue
    return held


def daemon_running(settings: Settings) -> bool:
    """Whether a daemon of this configuration runs now: it holds its --disk-dir's lock for its life."""
    lock = state_dir(settings) / "daemon.lock"
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def check_disk(settings: Settings, host: Host) -> list[Finding]:
    disk = settings.tiers.disk
    if "disk" not in settings.tiers.chain or not disk.enabled:
        return [skip("disk", "the disk tier is off (--disk-bytes 0, or not in --tiers)")]
    directory = state_dir(settings)
    base = existing_ancestor(directory)
    if not os.access(base, os.W_OK | os.X_OK):
        what = "" if base == directory else f" (it does not exist, and its parent {base} cannot be written)"
        return [fail("disk", f"--disk-dir {directory} is not writable by uid {os.getuid()}{what}",
                     "give the daemon's user the directory (chown, or an init container that does), or point "
                     "--disk-dir at a volume it owns")]
    findings = []
    if daemon_running(settings):  # the daemon these settings describe (doctor run beside it), or a second start
        findings.append(ok("disk", f"the strata daemon of --disk-dir {directory} is running (it holds the "
                                   "directory's lock; another daemon needs a --disk-dir of its own)"))
    st = os.statvfs(base)
    free = st.f_bavail * st.f_frsize
    held = _held_bytes(directory) if directory.exists() else 0
    available, wanted = free + held, int(disk.bytes)
    mount = mount_of(base.resolve(), host.mountinfo)
    fstype = mount.fstype if mount else "unknown"
    created = "" if directory.exists() else ", created at start"
    where = (f"--disk-dir {directory} ({fstype}{created}): {size(free)} free"
             + (f" + {size(held)} of blocks already held" if held else "") + f"; --disk-bytes {size(wanted)}")
    if available < wanted:
        findings.append(fail("disk", f"{where}: the disk tier would hold only {size(available)}",
                             f"give --disk-dir a volume with {size(wanted)} free (a hostPath or local volume on the "
                             f"node's NVMe), free space there, or lower --disk-bytes to {size(available)}"))
    else:
        findings.append(ok("disk", where))
    if fstype in MEMORY_FS:
        findings.append(warn("disk", f"--disk-dir {directory} is on {fstype}: the disk tier takes memory, and is "
                                     "gone at a reboot", "point --disk-dir at the node's NVMe"))
    elif fstype in CONTAINER_LAYER_FS:
        findings.append(warn("disk", f"--disk-dir {directory} is in the container's writable layer ({fstype}): "
                                     "its blocks go when the container is replaced, and the layer is slow",
                             "mount a volume there (a hostPath or local volume on the node's NVMe)"))
    return findings
