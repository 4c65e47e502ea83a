"""The weight cache on disk: where each file lives, which ones this process verified, and how a
version directory comes to be (linked from a snapshot's shards, rebuilt from deltas, or installed
whole), never half-built.

Layout under `root`: `shards/<sha256>.safetensors` (snapshot shards, content-addressed, shared
between versions), `deltas/<sha256>.zst` (delta blobs), `versions/v<N>/` (manifest.json + hard
links to the version's shards, or a rebuilt version's own `tensors-*.safetensors`), `tmp/` (files
being received, directories being built). One cache dir per worker process (or per machine when
workers share it read-mostly).

A file is trusted only if this process hashed it itself and it is still that very file (inode,
size, mtime); a version directory only if this process checked it. Only `versions/` dirs are
handed to engines, and only verified files to peers (`VerifiedFiles`, what `PeerServer` serves).
What the cache tells its peers (a blob found verified again, a blob or version gone) goes through
the callables it is given: this module knows nothing of peers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import shutil
import uuid
from collections.abc import Awaitable, Callable, Container, Iterable
from pathlib import Path
from typing import BinaryIO, Protocol

from rlboost import wire
from rlboost.logs import get_logger
from rlboost.procs import pid_alive
from rlboost.weights import deltas
from rlboost.weights.errors import StoreError, VersionUnavailable
from rlboost.weights.manifest import Delta, Manifest, ShardEntry, check_shard_id
from rlboost.weights.rebuild import BaseFiles, rebuild
from rlboost.weights.safetensors_io import RECONSTRUCTED_GLOB, load_tensors
from rlboost.weights.stats import CacheStats

log = get_logger(component="weights")

__all__ = ["CacheDir", "VerifiedFiles", "Step", "file_sha256"]

_SHA_HEX = re.compile(r"[0-9a-f]{64}")
Step = tuple[Manifest, Delta]  # a version and the delta replayed to reach it (its `delta`, or its snapshot delta)


class VerifiedFiles(Protocol):
    """What a peer server hands out (`rlboost.weights.peerhttp.PeerServer`): only files the
    cache verified itself. `WeightCache` and `CacheDir` are such."""

    def open_verified(self, sha: str) -> BinaryIO | None: ...

    def open_version_file(self, digest: str, index: int) -> BinaryIO | None: ...


class CacheDir:
    """One cache directory and what this process knows to be verified in it.

    `advertise(sha)`: awaited when a cached blob is found verified again (e.g. a restarted
    worker's cache: servable again); `withdraw(sha)` / `withdraw(key=...)`: called when a blob or
    a whole version leaves the disk. Both None: no peers."""

    def __init__(self, root: str | os.PathLike[str], stats: CacheStats, *,
                 advertise: Callable[[str], Awaitable[None]] | None = None,
                 withdraw: Callable[..., None] | None = None) -> None:
        self.root = Path(root)
        self.stats = stats
        self.advertise, self.withdraw = advertise, withdraw
        self.shards_dir, self.deltas_dir, self.versions_dir, self.tmp_dir = (
            self.root / d for d in ("shards", "deltas", "versions", "tmp"))
        for d in (self.shards_dir, self.deltas_dir, self.versions_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._clean_leftovers()
        self._verified: dict[str, tuple[int, int, int]] = {}  # sha -> (inode, size, mtime_ns) hashed OK
        self._verified_dirs: dict[int, str] = {}  # version -> manifest digest of a dir this process checked

    # -- where things are

    def vdir(self, version: int) -> Path:
        return self.versions_dir / f"v{version:012d}"

    def shard_path(self, sha: str, delta: bool = False) -> Path:
        """Inside shards/ (deltas/) or refused: the manifest door validates ids, this is the second lock."""
        where = self.deltas_dir if delta else self.shards_dir
        path = (where / f"{check_shard_id(sha)}.{'zst' if delta else 'safetensors'}").resolve()
        if path.parent != where.resolve():
            raise StoreError(f"shard path {path} is outside {where}")
        return path

    def part_path(self, sha: str) -> Path:
        """A file being received: `<sha>.<pid>-<rand>.part`, so that a dead process's are found."""
        return self.tmp_dir / f"{sha}.{os.getpid()}-{uuid.uuid4().hex[:8]}.part"

    def tmp_version_dir(self, version: int) -> Path:
        """A fresh directory in tmp/ to build `version`'s directory in (then `install` it)."""
        tmp = self.tmp_dir / f"{self.vdir(version).name}.{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        return tmp

    def local_manifest(self, version: int) -> Manifest | None:
        """The manifest of `version`'s cached directory, if there is one (not a check of its files)."""
        with contextlib.suppress(FileNotFoundError, StoreError):
            m = Manifest.decode((self.vdir(version) / "manifest.json").read_bytes())
            if m.version == version:
                return m
        return None

    def missing(self, snapshot: Manifest) -> int:
        """Bytes of the snapshot's shards the cache lacks."""
        return sum(s.size for s in snapshot.shards if not self.shard_path(s.sha256, False).exists())

    # -- blobs: verified, or refused

    async def valid(self, shard: ShardEntry, delta: bool) -> bool:
        """A cached file is used only if its size matches and its SHA-256 was checked — by this
        process, on this very file (inode, size, mtime); otherwise it is hashed again."""
        path = self.shard_path(shard.sha256, delta)
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        ident = (st.st_ino, st.st_size, st.st_mtime_ns)
        if st.st_size == shard.size and self._verified.get(shard.sha256) == ident:
            return True
        if st.st_size == shard.size:
            digest = await asyncio.to_thread(file_sha256, path)
            if digest == shard.sha256:
                self._verified[shard.sha256] = ident
                if self.advertise is not None:  # e.g. a restarted worker's cache: servable again
                    await self.advertise(shard.sha256)
                return True
        self.refuse(shard, f"cached copy is {'corrupt' if st.st_size == shard.size else 'truncated'}", st.st_size)
        path.unlink(missing_ok=True)
        return False

    def keep(self, received: Path, sha: str, delta: bool) -> Path:
        """A received file the caller verified, moved to its place and remembered as verified."""
        path = self.shard_path(sha, delta)
        os.replace(received, path)
        st = path.stat()
        self._verified[sha] = (st.st_ino, st.st_size, st.st_mtime_ns)
        return path

    def refuse(self, shard: ShardEntry, reason: str, got_bytes: int) -> None:
        self.stats.shards_refused += 1
        self._verified.pop(shard.sha256, None)
        log.warning("weight shard refused", shard=shard.sha256[:16], reason=reason, expected_bytes=shard.size,
                    got_bytes=got_bytes)

    # -- version directories

    async def cached(self, manifest: Manifest) -> bool:
        """`versions/v<N>` holds exactly this manifest's weights, checked by this process: a
        snapshot's hard links to verified shards, a reconstructed version's tensors re-hashed
        once per process (a restarted worker does not trust a file it did not check)."""
        vdir = self.vdir(manifest.version)
        try:
            if Manifest.decode((vdir / "manifest.json").read_bytes()) != manifest:
                return False
        except (OSError, StoreError):
            return False
        if self._verified_dirs.get(manifest.version) == manifest.digest():
            return True
        if any(vdir.glob(RECONSTRUCTED_GLOB)):  # rebuilt from deltas (a snapshot may have been too)
            if not await asyncio.to_thread(_tensors_match, vdir, manifest):
                return False
            self.mark_checked(manifest)
            return True
        if not manifest.snapshot or not await asyncio.to_thread(self._version_dir_current, vdir, manifest):
            return False
        for s in manifest.shards:  # re-hashes a shard this process has not checked yet
            if not await self.valid(s, delta=False):
                return False
        return True

    def mark_checked(self, manifest: Manifest) -> None:
        """This process checked every tensor of `manifest`'s directory (rebuilt, or taken whole)."""
        self._verified_dirs[manifest.version] = manifest.digest()

    def link_version(self, manifest: Manifest) -> Path:
        """(Re)build versions/v<N> as hard links to the verified shard files. Built in tmp/ and
        renamed into place, so a reader never sees a half-built directory."""
        vdir = self.vdir(manifest.version)
        if self._version_dir_current(vdir, manifest):
            return vdir
        tmp = self.tmp_version_dir(manifest.version)
        for s in manifest.shards:
            src, dst = self.shard_path(s.sha256), tmp / f"{s.sha256}.safetensors"
            try:
                os.link(src, dst)
            except OSError:  # a filesystem without hard links
                shutil.copyfile(src, dst)
        (tmp / "manifest.json").write_bytes(manifest.encode())
        self.install(tmp, vdir)
        self._verified_dirs.pop(manifest.version, None)
        return vdir

    def _version_dir_current(self, vdir: Path, manifest: Manifest) -> bool:
        try:
            if Manifest.decode((vdir / "manifest.json").read_bytes()) != manifest or any(vdir.glob(RECONSTRUCTED_GLOB)):
                return False
            return all(os.path.samefile(vdir / f"{s.sha256}.safetensors", self.shard_path(s.sha256))
                       for s in manifest.shards)
        except (OSError, StoreError):
            return False

    def rebuilt(self, start: Manifest, chain: list[Step], shard_file: Callable[[str], Path] | None,
                parallel: int) -> None:
        """(thread) Replay the steps of `chain` (oldest first) on `start`'s cached tensors into a
        new directory in tmp/, every tensor checked against the target's SHA-256 before it is
        written (`rlboost.weights.rebuild`, on `parallel` threads), then rename the directory into
        versions/. Raises DeltaCorrupt on any mismatch; nothing is installed then.

        `shard_file` (a snapshot start still arriving): the base tensors are read from the file
        `shard_file(sha)` returns once each is in; otherwise from `start`'s version dir."""
        target = chain[-1][0]
        if shard_file:
            base = BaseFiles(start, shard_file=shard_file)
        else:
            vdir = self.vdir(start.version)
            try:
                if Manifest.decode((vdir / "manifest.json").read_bytes()) != start:
                    raise VersionUnavailable(f"{vdir} no longer holds version {start.version}")
            except FileNotFoundError:
                raise VersionUnavailable(f"{vdir} is gone") from None
            whole = sorted(vdir.glob(RECONSTRUCTED_GLOB))
            base = BaseFiles(start, whole_files=whole) if whole else \
                BaseFiles(start, shard_file=lambda sha: vdir / f"{check_shard_id(sha)}.safetensors")
        tmp = self.tmp_version_dir(target.version)
        try:
            blobs = {b.sha256: self.shard_path(b.sha256, True).read_bytes() for _, d in chain for b in d.blobs}
            rebuild(target, chain, base, blobs, tmp, parallel)
            (tmp / "manifest.json").write_bytes(target.encode())
            self.install(tmp, self.vdir(target.version))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            base.close()
        self.mark_checked(target)

    def install(self, tmp: Path, vdir: Path) -> None:
        """Rename a finished directory into versions/, replacing an old one atomically enough:
        a reader sees the old directory or the new one, never a half-built one."""
        if vdir.exists():
            trash = self.tmp_dir / f"old-{vdir.name}.{uuid.uuid4().hex[:8]}"
            os.replace(vdir, trash)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(tmp, vdir)

    # -- what peers are served (VerifiedFiles)

    def open_version_file(self, digest: str, index: int) -> BinaryIO | None:
        """File `index` of a version this process rebuilt (or took whole) and checked, whose
        manifest digest is `digest`, opened for reading; else None. What a `PeerServer` serves
        to late joiners (`rlboost.weights.peer_versions`), who check every byte again."""
        for v, d in list(self._verified_dirs.items()):
            if d == digest:
                with contextlib.suppress(OSError):
                    return open(self.vdir(v) / f"tensors-{index:05d}.safetensors", "rb")  # noqa: SIM115
        return None

    def open_verified(self, sha: str) -> BinaryIO | None:
        """A blob (shard or delta) this process hashed itself, opened for reading, if the file is
        still exactly the one it hashed (inode, size, mtime); else None. What a `PeerServer`
        serves: nothing unverified ever leaves this cache."""
        if not _SHA_HEX.fullmatch(sha):
            return None
        for delta in (False, True):
            try:
                f = open(self.shard_path(sha, delta), "rb")  # noqa: SIM115 - the caller closes it
            except (FileNotFoundError, StoreError):
                continue
            st = os.fstat(f.fileno())
            if self._verified.get(sha) == (st.st_ino, st.st_size, st.st_mtime_ns):
                return f
            f.close()
        return None

    # -- housekeeping

    def _clean_leftovers(self) -> None:
        """A process killed mid-pull leaves its partial downloads in tmp/ (`<sha>.<pid>-<rand>.part`):
        delete those of processes that are gone, so a restarted worker's cache holds nothing
        half-written. A live process's (a cache shared between workers) are left alone; a name
        without a pid (older builds) counts as a dead owner's."""
        for p in self.tmp_dir.glob("*.part"):
            owner = p.name.split(".")[-2].split("-")[0] if p.name.count(".") >= 2 else ""
            if owner.isdigit() and int(owner) != os.getpid() and pid_alive(int(owner)):
                continue
            with contextlib.suppress(OSError):
                p.unlink()
                log.info("removed a partial download left by a killed pull", path=str(p))

    def cached_versions(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.versions_dir.glob("v*") if p.name[1:].isdigit())

    def prune(self, keep: int, also_keep: Iterable[int] = (), fetching: Container[str] = ()) -> list[int]:
        """Drop all but the newest `keep` version dirs (and `also_keep`, e.g. versions still
        serving requests), then blobs no remaining version uses (and none `fetching` now).
        Returns dropped versions."""
        versions = self.cached_versions()
        keep_set = set(versions[-keep:] if keep > 0 else []) | set(also_keep)
        dropped = [v for v in versions if v not in keep_set]
        for v in dropped:
            shutil.rmtree(self.vdir(v), ignore_errors=True)
        live: set[str] = set()
        for v in keep_set:
            with contextlib.suppress(FileNotFoundError, StoreError):
                m = Manifest.decode((self.vdir(v) / "manifest.json").read_bytes())
                live.update(s.sha256 for s in m.shards)
                live.update(b.sha256 for b in (m.delta.blobs if m.delta else []))
        for v in dropped:
            digest = self._verified_dirs.pop(v, None)
            if digest and self.withdraw is not None:
                self.withdraw(key=wire.peer_version_key(digest))
        for p in [*self.shards_dir.glob("*.safetensors"), *self.deltas_dir.glob("*.zst")]:
            sha = p.name.split(".")[0]
            if sha not in live and sha not in fetching:
                p.unlink(missing_ok=True)
                self._verified.pop(sha, None)
                if self.withdraw is not None:
                    self.withdraw(sha)
        return dropped


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _tensors_match(vdir: Path, manifest: Manifest) -> bool:
    """(thread) Every tensor of a reconstructed directory hashes to the manifest's SHA-256."""
    try:
        tensors = load_tensors(vdir, expect_version=manifest.version)
        return all(e.sha256 and deltas.tensor_sha256(tensors[e.name]) == e.sha256 for e in manifest.tensors)
    except (OSError, StoreError, KeyError, ValueError):
        return False
