"""Where an origin keeps the manifests of its revision, and how one is found.

Beside the model's files, in the catalog folder::

    <revision>/.strata/manifests/<digest>.json   one per publish, named by its BLAKE3 digest
    <revision>/.strata/latest                    the digest of the newest publish (text)

Manifests are content-addressed and never overwritten in place, so a node
that pinned a digest keeps finding that manifest after a re-publish; if the
files changed meanwhile, their chunks no longer match it and the node says
so (``ManifestMismatch``) instead of serving a mix. ``latest`` only says
which digest a caller gets when it names none; a caller that needs
repeatable results pins the digest (``open_model(..., digest=...)``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from weightcache.errors import ManifestError, NotPublished, quoted
from weightcache.manifest import MAX_MANIFEST_BYTES, Manifest
from weightcache.origin.base import CATALOG_DIR, Origin

MANIFESTS = f"{CATALOG_DIR}/manifests"
LATEST = f"{CATALOG_DIR}/latest"
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
MAX_LISTED = 1000


@dataclass(frozen=True)
class Published:
    manifest: Manifest
    latest: bool


def manifest_path(digest: str) -> str:
    return f"{MANIFESTS}/{check_digest(digest)}.json"


def check_digest(digest: str) -> str:
    if not isinstance(digest, str) or not _DIGEST.match(digest):
        raise ManifestError(
            f"manifest digest {quoted(digest)} must be 64 lowercase hex characters (what publish printed)")
    return digest


async def store(origin: Origin, manifest: Manifest) -> None:
    """Store the manifest under its digest, then point ``latest`` at it (in that order, so
    ``latest`` never names a manifest that is not there)."""
    path = manifest_path(manifest.digest)
    if await origin.get(path, MAX_MANIFEST_BYTES) != manifest.encoded:
        await origin.put(path, manifest.encoded)
    await origin.put(LATEST, f"{manifest.digest}\n".encode())


async def latest_digest(origin: Origin) -> str | None:
    raw = await origin.get(LATEST, 1024)
    if raw is None:
        return None
    return check_digest(raw.decode("ascii", "replace").strip())


async def resolve(origin: Origin, digest: str | None = None) -> Manifest:
    """The manifest ``digest`` names (the latest one when None), verified against its digest."""
    if digest is None:
        digest = await latest_digest(origin)
        if digest is None:
            raise NotPublished(
                f"{origin.location} has no published manifest ({LATEST} is missing): run "
                f"'strata weights publish {origin.location}' first"
            )
    raw = await origin.get(manifest_path(digest), MAX_MANIFEST_BYTES)
    if raw is None:
        raise NotPublished(
            f"{origin.location} has no manifest {digest} ({manifest_path(digest)} is missing): publish the model "
            f"there, or open the digest 'strata weights ls {origin.location}' lists"
        )
    return Manifest.from_bytes(raw, expect_digest=digest, where=origin.where(manifest_path(digest)))


async def published(origin: Origin) -> list[Published]:
    """Every manifest stored at the origin (at most MAX_LISTED), the latest first."""
    names = [p for p, _ in await origin.list_files(catalog=True) if p.startswith(f"{MANIFESTS}/") and p.endswith(".json")]
    latest = await latest_digest(origin)
    out = []
    for p in names[:MAX_LISTED]:
        digest = p[len(MANIFESTS) + 1 : -len(".json")]
        if _DIGEST.match(digest):
            out.append(Published(await resolve(origin, digest), digest == latest))
    return sorted(out, key=lambda x: (not x.latest, x.manifest.revision, x.manifest.digest))

