"""A manifest of a dataset in object storage: what every rank would otherwise rediscover.

`write_index(ds, index_dir=DIR)` (or `stoker index URL --index-dir DIR`) over a Dataset whose
fields are URLs writes one object, `DIR/stoker-manifest.json.gz` (DIR a local directory or
itself a URL): per field its patterns and record layout, and per group and field the object's
URL, size, mtime, ETag and version id, its record count and, for a gzip/zlib object, its
decompressed size and the start of every gzip member with the local index's checks (a CRC-32
of the entry's values, `stoker.io.index.entry_check`, and one of each member's first KiB).
It is gzip-compressed JSON: a line naming the format and the build id (a hash of the body),
then the body, whose hash is checked before it is parsed.

`Dataset(..., index_dir=DIR)` over fields that are all URLs reads that one object and builds
from it alone: no listing, no `info`, no header or trailer read, so building a Dataset on
10,000 ranks costs 10,000 GETs of one object instead of 10,000 x (listings + an `info` and two
ranged GETs per object). Every read is then held to the manifest's ETag/version id (see
`stoker.io.remote.Version`): an object replaced since the manifest was written is a
`stoker.errors.StaleIndexError` naming the object and the manifest, before any of its bytes is
handed on. A manifest written for other fields (names, patterns or record layout) is refused
naming the field that differs; `index="ignore"` and `index="rebuild"` never read it (the
Dataset is built by listing, and `write_index` of it writes the manifest anew). The groups were paired when it
was written (its `pair_key` is not applied again).

Written atomically: a local manifest through a temporary file, fsync and rename; a remote one
by one PUT of the whole object, which a store makes visible whole or not at all.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import hashlib
import json
import os
import tempfile
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import PairingError, ReadError, SpecError, StaleIndexError
from . import seekpoints
from .index import IndexEntry, entry_from_scan, parse_entry, record_count
from .inflate import Inflater
from .remote import PART_BYTES, RemoteReader, Version, attempt, client, is_remote

if TYPE_CHECKING:
    from ..spec import Field
    from .files import Catalog, FileInfo

__all__ = ["MANIFEST_NAME", "MANIFEST_VERSION", "Manifest", "load_manifest", "manifest_path", "write_manifest"]

MANIFEST_NAME = "stoker-manifest.json.gz"
MANIFEST_VERSION = 1
_FORMAT = "stoker-manifest"
# Objects scanned at once by write_manifest: each is one stream of ranged GETs, so the store's
# latency, not this machine, bounds a lone stream.
_SCANS = 16


def manifest_path(index_dir: str) -> str:
    """The manifest file (or object) in `index_dir`."""
    return (
        index_dir.rstrip("/") + "/" + MANIFEST_NAME if is_remote(index_dir) else os.path.join(index_dir, MANIFEST_NAME)
    )


def _layout(spec: Field) -> dict[str, Any]:
    """What of a field the manifest's entries depend on: a Dataset whose fields differ is refused."""
    files = [spec.files] if isinstance(spec.files, str) else list(spec.files)
    return {
        "files": files,
        "record_bytes": spec.record_bytes,
        "header_bytes": spec.header_bytes,
        "footer_bytes": spec.footer_bytes,
        "compression": spec.compression,
    }


def _body_bytes(fields: Any, groups: Any) -> bytes:
    return json.dumps({"fields": fields, "groups": groups}, separators=(",", ":"), sort_keys=True).encode()


def _all_remote(fields: Mapping[str, Field]) -> bool:
    return bool(fields) and all(
        is_remote(p) for spec in fields.values() for p in ([spec.files] if isinstance(spec.files, str) else spec.files)
    )


def _options(fields: Mapping[str, Field]) -> Mapping[str, Any] | None:
    """The storage options a remote manifest is read and written with: its first field's."""
    return next(iter(fields.values())).storage_options if fields else None


@dataclass(frozen=True)
class Manifest:
    """A manifest read and checked: where it is, and its entries per group and field."""

    path: str
    groups: list[dict[str, dict[str, Any]]]

    def paths(self) -> dict[str, list[str]]:
        """Each field's URLs in pairing order, as globbing them would give."""
        names = list(self.groups[0]) if self.groups else []
        return {n: [g[n]["url"] for g in self.groups] for n in names}

    def files(self, fields: Mapping[str, Field]) -> list[dict[str, FileInfo]]:
        """The catalog's FileInfo of every group and field, their reads held to the manifest's
        versions; a StaleIndexError naming the manifest where an entry is not well formed."""
        from .files import FileInfo  # files.py imports this module

        out = []
        for g, entries in enumerate(self.groups):
            infos = {}
            for name in fields:
                try:
                    e = entries[name]
                    url, size, mtime, etag, vid, kind, records = (
                        e["url"], e["size"], e["mtime_ns"], e["etag"], e["version_id"], e["compression"], e["records"]
                    )  # fmt: skip
                    ok = (
                        type(url) is str and is_remote(url) and type(size) is int and type(mtime) is int
                        and type(records) is int and min(size, mtime, records) >= 0 and kind in (None, "gzip", "zlib")
                        and (etag is None or type(etag) is str) and (vid is None or type(vid) is str)
                    )  # fmt: skip
                except (KeyError, TypeError):
                    ok = False
                if not ok:
                    raise _refused(self.path, f"has a malformed entry for group {g} field {name!r}")
                version = Version(size, mtime, etag, vid, manifest=self.path)
                infos[name] = FileInfo(url, size, mtime, kind, records, version)
            out.append(infos)
        return out

    def apply(self, catalog: Catalog) -> None:
        """Give `catalog` the exact counts and member starts of its compressed objects."""
        for g, infos in enumerate(catalog.files):
            for name, info in infos.items():
                if info.compression is None:
                    continue
                entry = self.groups[g][name]
                total, points = parse_entry(self.path, info, entry, name)
                records = record_count(name, catalog.fields[name], info, total, source=" (per its manifest)")
                if records != entry["records"]:
                    raise _refused(self.path, f"group {g} field {name!r} gives {entry['records']} records for "
                                   f"{info.path!r}, its decompressed size {total}")  # fmt: skip
                catalog.set_indexed(g, name, records, points)


def _refused(path: str, why: str) -> StaleIndexError:
    return StaleIndexError(
        f"manifest {path!r} {why}; write it again with `stoker index URL --index-dir DIR` or stoker.write_index(ds, "
        "index_dir=DIR)",
        path=path,
    )


def _read(path: str, options: Mapping[str, Any] | None) -> bytes | None:
    """The manifest's bytes; None where there is none."""
    if not is_remote(path):
        try:
            with open(path, "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise _refused(path, f"cannot be read ({e.strerror})") from e
    c, p = client(path, options)
    try:
        # start=0: one GET (s3fs would otherwise HEAD it first, to split a large object)
        return bytes(c.run(attempt(path, "read", lambda: c.call("cat_file", p, start=0), field=None)))
    except ReadError as e:
        if isinstance(e.__cause__, FileNotFoundError):
            return None
        raise


def load_manifest(index_dir: str | None, fields: Mapping[str, Field], mode: str) -> Manifest | None:
    """The manifest in `index_dir` for `fields` (all URLs), checked; None where the fields are
    not all remote, no index_dir is given, `mode` is not "auto", or there is no manifest.

    Refused with a StaleIndexError naming it where it is not well formed, its build id does not
    match its body, or it was written for other fields.
    """
    if index_dir is None or mode != "auto" or not _all_remote(fields):
        return None
    path = manifest_path(index_dir)
    data = _read(path, _options(fields))
    if data is None:
        return None
    try:
        head, _, body = gzip.decompress(data).partition(b"\n")
        doc = json.loads(head)
    except (OSError, EOFError, zlib.error, ValueError, RecursionError) as e:
        raise _refused(path, f"cannot be read ({type(e).__name__}: {str(e)[:200]})") from e
    if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
        raise _refused(path, "is not a stoker manifest")
    if doc.get("version") != MANIFEST_VERSION:
        raise _refused(path, f"has format version {str(doc.get('version'))[:40]}, this stoker reads {MANIFEST_VERSION}")
    if doc.get("build") != hashlib.sha256(body).hexdigest()[:32]:
        raise _refused(path, "does not match its build id: it was changed after it was written")
    try:
        content = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise _refused(path, f"cannot be read ({type(e).__name__}: {str(e)[:200]})") from e
    written, groups = content.get("fields"), content.get("groups")
    if not isinstance(written, dict) or not isinstance(groups, list) or not all(type(g) is dict for g in groups):
        raise _refused(path, "is not a stoker manifest")
    want = {n: _layout(s) for n, s in fields.items()}
    if set(written) != set(want):
        raise _refused(path, f"was written for fields {sorted(written)}, not this Dataset's {sorted(want)} (keep "
                       "each dataset's manifest in its own index_dir)")  # fmt: skip
    for name, layout in want.items():
        if written[name] != layout:
            raise _refused(path, f"was written for field {name!r} as {written[name]}, not as this Dataset's {layout}")
    return Manifest(path, groups)


def _scan(name: str, spec: Field, info: FileInfo) -> tuple[int, list[tuple[int, int, int]]]:
    """(decompressed size, (compressed, decompressed, check) of each member) of a compressed
    object, by decoding it once at the version the Dataset was built on."""
    assert info.compression is not None
    heads = seekpoints.Heads()
    found: list[tuple[int, int, int]] = []
    buf = bytearray(1 << 20)
    view = memoryview(buf)
    with Inflater(info.path, info.compression, field=name, storage_options=spec.storage_options,
                  version=info.version) as inf:  # fmt: skip
        while True:
            at = inf.produced
            n = inf.readinto(view)
            for c, d in inf.members[len(found) :]:
                found.append((c, d, heads.add(d)))
            heads.feed(view[:n], at)
            if n < len(buf):
                break
        total = inf.produced
    members = [(c, d, seekpoints.point_check(c, 0, d, total, heads.crcs[k])) for c, d, k in found]
    return total, members


def _download(name: str, spec: Field, info: FileInfo, into: str) -> str:
    """The object, at the version the Dataset was built on, copied into a file in `into`."""
    reader = RemoteReader(info.path, spec.storage_options, size=info.size, field=name, version=info.version)
    fd, tmp = tempfile.mkstemp(prefix=".stoker-manifest.", suffix=".object", dir=into)
    try:
        with os.fdopen(fd, "wb") as f:
            at = 0
            while chunk := reader.pread(PART_BYTES, at):
                f.write(chunk)
                at += len(chunk)
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        reader.close()
    return tmp


def _with_points(name: str, spec: Field, info: FileInfo, home: str, spacing: int) -> IndexEntry:
    """The local index's entry of a compressed object (member starts and block seek points every
    `spacing` decompressed bytes), its windows written in `home` beside the manifest, as
    `stoker.io.index.scan` makes them for a local file."""
    assert info.compression is not None
    with tempfile.TemporaryDirectory(prefix=".stoker-manifest.", dir=home) as scratch:
        copy = _download(name, spec, info, scratch)
        found = seekpoints.scan_file(copy, info.compression, spacing=spacing, field=name)
    return entry_from_scan(info, home, found)


def _entry(name: str, spec: Field, info: FileInfo, home: str | None, spacing: int) -> dict[str, Any]:
    version = info.version or Version(info.size, info.mtime_ns)
    e: dict[str, Any] = {
        "url": info.path, "size": info.size, "mtime_ns": info.mtime_ns, "etag": version.etag,
        "version_id": version.version_id, "compression": info.compression,
    }  # fmt: skip
    if info.compression is None:
        assert info.records_hint is not None
        e["records"] = info.records_hint
        return e
    if home is not None and seekpoints.available():  # block seek points, their windows beside the manifest
        entry = _with_points(name, spec, info, home, spacing)
    else:
        total, members = _scan(name, spec, info)
        entry = IndexEntry(info.size, info.mtime_ns, info.compression, total, tuple(members))
    records = record_count(name, spec, info, entry.decompressed_bytes)
    doc = entry.to_json(records)
    del doc["size"], doc["mtime_ns"], doc["compression"]  # the object's, above
    return {**e, **doc}


def write_manifest(
    catalog: Catalog,
    index_dir: str,
    *,
    spacing: int = seekpoints.SPACING,
    progress: Callable[[str], None] | None = None,
) -> str:
    """Write the manifest of `catalog` (every field remote) into `index_dir`; returns its path or URL.

    Every compressed object is decoded once (`_SCANS` at a time), its reads held to the
    version the Dataset was built on, so an object replaced meanwhile fails the write. Where
    `index_dir` is a local directory, each compressed object also gets a seek point every
    `spacing` decompressed bytes, its windows in a file beside the manifest (as the local index
    keeps them); in a remote `index_dir` the manifest holds member starts only.
    """
    if not _all_remote(catalog.fields):
        raise SpecError("a manifest covers datasets whose fields are all URLs; index local files with write_index")
    home = None if is_remote(index_dir) else index_dir
    if home is not None:
        try:
            os.makedirs(home, exist_ok=True)
        except OSError as e:
            raise seekpoints.cannot_write_index(manifest_path(home), e, "manifest") from e
    names = list(catalog.fields)
    jobs = [(g, n) for g in range(catalog.num_groups) for n in names]
    groups: list[dict[str, dict[str, Any]]] = [{} for _ in range(catalog.num_groups)]
    with concurrent.futures.ThreadPoolExecutor(_SCANS) as pool:
        running = {
            pool.submit(_entry, n, catalog.fields[n], catalog.files[g][n], home, spacing): (g, n) for g, n in jobs
        }
        for done in concurrent.futures.as_completed(running):
            g, n = running[done]
            groups[g][n] = done.result()
            if progress is not None:
                progress(catalog.files[g][n].path)
    for g, entries in enumerate(groups):
        counts = {n: e["records"] for n, e in entries.items()}
        if len(set(counts.values())) > 1:
            detail = "; ".join(f"field {n!r}: {c} records in {entries[n]['url']!r}" for n, c in counts.items())
            raise PairingError(f"group {g} has different record counts per field: {detail}", field=names[0],
                               path=entries[names[0]]["url"])  # fmt: skip
    body = _body_bytes({n: _layout(s) for n, s in catalog.fields.items()}, groups)
    head = {"format": _FORMAT, "version": MANIFEST_VERSION, "build": hashlib.sha256(body).hexdigest()[:32]}
    # A line of JSON saying what follows, then the body it hashes: checked without parsing it twice.
    data = gzip.compress(json.dumps(head, sort_keys=True).encode() + b"\n" + body, 6, mtime=0)
    path = manifest_path(index_dir)
    if is_remote(path):
        c, p = client(path, _options(catalog.fields))
        c.run(attempt(path, "write", lambda: c.call("pipe_file", p, data), field=None))
    else:
        _write_local(path, data)
    return path


def _write_local(path: str, data: bytes) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as e:
        raise seekpoints.cannot_write_index(path, e, "manifest") from e
    seekpoints.write_atomic(path, data, prefix=".stoker-manifest.", what="manifest")
