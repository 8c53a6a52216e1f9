"""Streaming gzip/zlib decompression: members, padding, corruption, all naming the file."""

from __future__ import annotations

import gzip
import os
import zlib
from pathlib import Path

import pytest

import stoker
from stoker.io.inflate import Inflater, TruncatedStreamError, decompressed_size, gzip_trailer_size

DATA = bytes((i * 7 + i // 251) & 0xFF for i in range(300_000))


def _read_all(path: Path, kind: str, chunk: int = 10_000) -> bytes:
    out = bytearray()
    with Inflater(str(path), kind, field="f") as inf:
        buf = bytearray(chunk)
        while n := inf.readinto(memoryview(buf)):
            out += buf[:n]
        assert inf.at_end()
    return bytes(out)


@pytest.mark.parametrize("chunk", [1, 4093, 1 << 20])
def test_gzip_reads_back_exactly(tmp_path: Path, chunk: int) -> None:
    p = tmp_path / "a.gz"
    p.write_bytes(gzip.compress(DATA[: 20_000 if chunk == 1 else None]))
    assert _read_all(p, "gzip", chunk) == DATA[: 20_000 if chunk == 1 else None]


def test_zlib_reads_back_exactly(tmp_path: Path) -> None:
    p = tmp_path / "a.zz"
    p.write_bytes(zlib.compress(DATA, 6))
    assert _read_all(p, "zlib") == DATA


def test_multi_member_gzip_is_read_member_after_member(tmp_path: Path) -> None:
    p = tmp_path / "a.gz"
    p.write_bytes(gzip.compress(DATA[:1000]) + gzip.compress(b"") + gzip.compress(DATA[1000:]))
    assert _read_all(p, "gzip") == DATA
    assert decompressed_size(str(p), "gzip") == len(DATA)


def test_zero_padding_after_gzip_is_tolerated(tmp_path: Path) -> None:
    p = tmp_path / "a.gz"
    p.write_bytes(gzip.compress(DATA) + b"\0" * 4096)
    assert _read_all(p, "gzip") == DATA


def test_skip_discards_and_counts(tmp_path: Path) -> None:
    p = tmp_path / "a.gz"
    p.write_bytes(gzip.compress(DATA))
    with Inflater(str(p), "gzip") as inf:
        assert inf.skip(100_001) == 100_001
        buf = bytearray(10)
        assert inf.readinto(memoryview(buf)) == 10
        assert bytes(buf) == DATA[100_001:100_011]
        assert inf.skip(10**9) == len(DATA) - 100_011
        assert inf.produced == len(DATA)


@pytest.mark.parametrize(
    ("mangle", "what"),
    [
        (lambda c: c[: len(c) // 2], "truncated"),
        (lambda c: c[:-3], "truncated"),
        (lambda c: c + b"garbage!", "trailing"),
        (lambda c: c + b"\0\0\x01", "trailing"),
        (lambda c: c[:-8] + bytes([c[-8] ^ 1]) + c[-7:], "corrupt"),  # CRC flipped
        (lambda c: c[: len(c) // 2] + bytes([c[len(c) // 2] ^ 0x10]) + c[len(c) // 2 + 1 :], "corrupt"),
    ],
    ids=["half", "short-trailer", "garbage", "nonzero-padding", "crc", "bitflip"],
)
def test_corrupt_gzip_raises_corrupt_data_error_naming_the_file(tmp_path: Path, mangle, what: str) -> None:
    p = tmp_path / "labels.gz"
    p.write_bytes(mangle(gzip.compress(DATA)))
    with pytest.raises(stoker.CorruptDataError) as info:
        _read_all(p, "gzip")
    assert str(p) in str(info.value)
    assert info.value.path == str(p)
    assert info.value.field == "f"
    assert info.value.offset is not None
    with pytest.raises(stoker.CorruptDataError, match="labels.gz"):
        decompressed_size(str(p), "gzip")


def test_truncated_zlib_raises_naming_the_file(tmp_path: Path) -> None:
    p = tmp_path / "x.zz"
    p.write_bytes(zlib.compress(DATA)[:-100])
    with pytest.raises(stoker.CorruptDataError, match="x.zz"):
        _read_all(p, "zlib")


def test_missing_file_raises_read_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(stoker.ReadError, match="gone.gz") as info:
        Inflater(str(tmp_path / "gone.gz"), "gzip")
    assert isinstance(info.value, OSError)


def test_close_is_idempotent_and_closes_the_descriptor(tmp_path: Path) -> None:
    p = tmp_path / "a.gz"
    p.write_bytes(gzip.compress(DATA))
    before = len(os.listdir("/proc/self/fd"))
    inf = Inflater(str(p), "gzip")
    assert len(os.listdir("/proc/self/fd")) == before + 1
    inf.close()
    inf.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_gzip_trailer_size_reads_isize_of_the_last_member(tmp_path: Path) -> None:
    p = tmp_path / "a.gz"
    p.write_bytes(gzip.compress(DATA[:10]) + gzip.compress(DATA[:1234]))
    fd = os.open(p, os.O_RDONLY)
    try:
        assert gzip_trailer_size(fd, p.stat().st_size) == 1234
        assert gzip_trailer_size(fd, 17) is None
    finally:
        os.close(fd)


def test_a_member_whose_magic_is_cut_by_a_read_boundary_is_still_a_member(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the first byte (1f) of the second member in one read: read on before judging it,
    not take it for trailing garbage (a valid two-member file was refused)."""
    from stoker.io import inflate

    first = gzip.compress(bytes(range(256)) * 40, mtime=0)
    second = gzip.compress(b"xyz" * 100, mtime=0)
    path = tmp_path / "two.gz"
    path.write_bytes(first + second)
    for chunk in (len(first) - 1, len(first) + 1):  # the cut before 1f, and inside the magic
        monkeypatch.setattr(inflate, "_CHUNK", chunk)
        assert _read_all(path, "gzip") == bytes(range(256)) * 40 + b"xyz" * 100, chunk
        assert decompressed_size(str(path), "gzip") == 256 * 40 + 300


@pytest.mark.parametrize("how", ["readinto", "skip"])
def test_a_truncation_error_names_the_offset_where_the_stream_stops(tmp_path: Path, how: str) -> None:
    """Not the offset where the read that found it began (it said 0 though .index was 1483)."""
    p = tmp_path / "cut.gz"
    p.write_bytes(gzip.compress(DATA, 6)[: len(gzip.compress(DATA, 6)) // 2])
    with Inflater(str(p), "gzip", field="f") as inf, pytest.raises(TruncatedStreamError) as e:
        if how == "readinto":
            inf.readinto(memoryview(bytearray(len(DATA))))
        else:
            inf.skip(len(DATA))
    assert 0 < e.value.offset == inf.produced < len(DATA)  # type: ignore[operator]
    assert f"decompressed offset {inf.produced})" in str(e.value)
    assert DATA.startswith(zlib.decompressobj(31).decompress(p.read_bytes())[: inf.produced])


def test_a_loader_s_truncation_error_agrees_with_its_record_index(tmp_path: Path) -> None:
    """A group decoded whole: .index, .offset and the message tell the same place."""
    import numpy as np

    records = np.arange(3000 * 16, dtype="<i4").reshape(3000, 16)  # 64-byte records
    good = gzip.compress(records.tobytes(), 6)
    # Cut, with the trailer's size kept: the count is taken from it and the group decoded whole.
    (tmp_path / "img_0.bin.gz").write_bytes(good[: len(good) // 2] + good[-4:])
    (tmp_path / "lab_0.bin").write_bytes(np.arange(3000, dtype="<i4").tobytes())
    ds = stoker.Dataset(
        x=stoker.Field(str(tmp_path / "img_*.bin.gz"), "int32", (16,)),
        y=stoker.Field(str(tmp_path / "lab_*.bin"), "int32"),
    )
    with pytest.raises(TruncatedStreamError) as e:
        list(ds.loader(100))
    err = e.value
    assert err.index is not None and err.index > 0 and err.offset is not None
    assert err.index == err.offset // 64 and f"decompressed offset {err.offset})" in str(err)
