"""Every reader's errors come from stoker.io.faults: each names the field, the file, the record
and the byte offset the same way, as attributes and in its message, and is the right class."""

from __future__ import annotations

import errno

import numpy as np
import pytest

from stoker.errors import CorruptDataError, ReadError
from stoker.io import faults
from stoker.io.files import FileInfo
from stoker.spec import Field

# 10-byte records after a 16-byte header, with a 4-byte footer: record k starts at 16 + 10k.
SPEC = Field("unused_*.bin", "uint8", (10,), header_bytes=16, footer_bytes=4)
RAW = FileInfo("/data/img_0003.bin", size=16 + 10 * 50 + 4, mtime_ns=1, compression=None, records_hint=50)
GZ = FileInfo("/data/lab_0003.bin.gz", size=999, mtime_ns=1, compression="gzip", records_hint=50)

CASES = [
    # (error, class, index, offset, words its message must hold)
    (faults.cut_since_built("img", RAW, 300), CorruptDataError, None, 300, ["300 bytes now", "520 bytes"]),
    (faults.cut_short("img", SPEC, RAW, 300, 296), CorruptDataError, 28, 296, ["reading record 28", "offset 296"]),
    (faults.resized("img", SPEC, RAW, 600, 49), CorruptDataError, 49, 506, ["record 49 asked for", "offset 506"]),
    (faults.truncated("img", RAW, SPEC, 3, 20, 8, 250), CorruptDataError, 23, 250, ["inside record 23 of group 3"]),
    (faults.read_failed("img", RAW, SPEC, 116, OSError(errno.EIO, "I/O error")), ReadError, 10, 116, ["I/O error"]),
    (faults.short_stream("lab", SPEC, GZ, 50, 77), CorruptDataError, 6, 77, ["decompressed offset 77", "6 of 50"]),
    (faults.stream_short("lab", GZ, 3, 50, 40, 420), CorruptDataError, 40, 420, ["record 40 is missing"]),
    (faults.seek_beyond_end("lab", GZ, 45, 466, 400), CorruptDataError, 45, 400, ["before record 45"]),
    (faults.header_short("lab", SPEC, GZ, 9), CorruptDataError, None, 9, ["header_bytes=16"]),
    (faults.footer_short("lab", SPEC, GZ, 50, 518), CorruptDataError, 50, 518, ["footer_bytes=4", "record 49"]),
    (faults.no_end("lab", SPEC, GZ, 50, 521), CorruptDataError, 50, 521, ["does not end after its 50 records"]),
    (faults.runs_on("lab", GZ, 3, 50, 520), CorruptDataError, 50, 520, ["more than the 50 records of group 3"]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: type(c[0]).__name__ + ":" + str(c[0])[:40])
def test_each_fault_names_field_file_record_and_offset(case: tuple) -> None:
    error, cls, index, offset, words = case
    assert type(error) is cls
    info = RAW if error.path == RAW.path else GZ
    name = "img" if info is RAW else "lab"
    assert error.path == info.path and info.path in str(error)
    assert error.field == name and f"field {name!r}" in str(error)
    assert error.offset == offset
    if index is not None:
        assert error.index == index
    for word in words:
        assert word in str(error)


def test_a_gather_from_a_cut_file_names_the_first_record_it_no_longer_holds() -> None:
    # 250 bytes hold 23 whole records (16 + 23*10 = 246): of 5, 20, 30 the first missing is 30.
    error = faults.gather_truncated("img", RAW, SPEC, 3, np.array([5, 20, 30, 40]), 250)
    assert isinstance(error, CorruptDataError) and error.index == 30 and error.offset == 250
    assert "inside record 30 of group 3" in str(error) and RAW.path in str(error)


def test_a_bus_error_is_a_cut_file_where_the_file_shrank_else_a_failed_read() -> None:
    bus = OSError(errno.EFAULT, "Bad address")
    shrank = faults.map_fault("img", RAW, SPEC, 3, 20, 8, bus, now=250, mapped=520, offset=300)
    assert isinstance(shrank, CorruptDataError) and shrank.index == 23 and shrank.offset == 250
    whole = faults.map_fault("img", RAW, SPEC, 3, 20, 8, bus, now=520, mapped=520, offset=306)
    assert isinstance(whole, ReadError) and whole.index == 29 and whole.offset == 306
    assert "bus error reading its memory map" in str(whole) and RAW.path in str(whole)
    unknown = faults.map_fault("img", RAW, SPEC, 3, 20, 8, bus, now=520, mapped=520, offset=-1)
    assert unknown.offset == 16 + 20 * 10  # where the batch's first record starts


def test_the_note_on_a_foreign_error_names_field_file_group_and_records() -> None:
    note = faults.reading_note("img", RAW, 3, 20, 28)
    assert note == "stoker: while reading field 'img' from '/data/img_0003.bin' (group 3, records 20..27)"
