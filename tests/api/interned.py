"""CPython 3.11's interned-string table (the dict behind ``sys.intern``), read from this process.

A mortal interned string that dies is deleted from the table, and a deleted entry stays a dummy
until the table is rebuilt: the table resizes once its entries, live and dummies, reach two thirds
of its slots. A server that interns a string per request and frees it again (``pathlib`` interns
every part of a path it parses) grows the counter of entries by one per request and, after
thousands, doubles the table (with ~36,000 strings: 0.94 MB to 1.88 MB) although the strings
held stay the same.

The table is a static pointer in the interpreter (``interned`` in ``Objects/unicodeobject.c``),
found by scanning the interpreter's writable data for a pointer to a dict that holds a string
interned just now (read through ``/proc/self/mem``: a stray pointer reads as an error, not a
crash). The counters are read from the 3.11 layout of ``PyDictObject`` and ``PyDictKeysObject``,
checked against what Python itself says (``len``, two thirds of the slots usable, one more entry
for a string interned). Elsewhere than CPython 3.11 on Linux, :func:`interned_table` raises.
"""

from __future__ import annotations

import os
import struct
import sys
import uuid
from dataclasses import dataclass

EXPECTED = (3, 11)


class LayoutError(AssertionError):
    """This interpreter's interned table is not where, or not what, CPython 3.11's is."""


@dataclass(frozen=True)
class Counts:
    used: int  # live strings
    entries: int  # live and deleted (dk_nentries): grows by one per string interned and freed
    usable: int  # entries left before the table resizes (dk_usable)
    log2_size: int  # the table's slots, as a power of two


def _writable_data() -> list[tuple[int, int]]:
    """(start, end) of the interpreter's writable data (.data, .bss: the file's rw mapping and the
    anonymous one right after it), in libpython where it is a shared library, else the executable."""
    with open("/proc/self/maps") as f:
        rows = [line.split() for line in f]
    files = {r[5] for r in rows if len(r) >= 6}
    lib = next((p for p in files if os.path.basename(p).startswith("libpython3")), None)
    target = lib or os.path.realpath(sys.executable)
    spans = []
    for i, row in enumerate(rows):
        if len(row) >= 6 and row[5] == target and row[1].startswith("rw"):
            spans.append(tuple(int(x, 16) for x in row[0].split("-")))
            after = rows[i + 1] if i + 1 < len(rows) else []
            if len(after) == 5 and after[1].startswith("rw"):  # anonymous: the rest of .bss
                spans.append(tuple(int(x, 16) for x in after[0].split("-")))
    return spans  # type: ignore[return-value]


class InternedTable:
    def __init__(self) -> None:
        if sys.implementation.name != "cpython" or sys.version_info[:2] != EXPECTED or not sys.platform.startswith("linux"):
            raise LayoutError(f"the interned table is read on CPython {EXPECTED[0]}.{EXPECTED[1]} on Linux only, not {sys.version}")
        self._mem = os.open("/proc/self/mem", os.O_RDONLY)
        self.address = self._find()
        self._check()

    def close(self) -> None:
        os.close(self._mem)

    def _read(self, address: int, size: int) -> bytes | None:
        try:
            data = os.pread(self._mem, size, address)
        except (OSError, OverflowError):
            return None
        return data if len(data) == size else None

    def _find(self) -> int:
        probe = sys.intern(f"interned-probe-{uuid.uuid4().hex}")
        dict_type = id(dict)
        found = []
        for start, end in _writable_data():
            data = self._read(start, end - start) or b""
            for (word,) in struct.iter_unpack("<Q", data):
                if word & 7 or word < 4096:
                    continue
                head = self._read(word, 24)  # ob_refcnt, ob_type, ma_used
                if head is None:
                    continue
                refcnt, type_, used = struct.unpack("<qQq", head)
                # a live dict (a freed one in the free list has no references: not to be touched)
                if type_ == dict_type and refcnt > 0 and used > 1000:
                    found.append(word)
        for address in dict.fromkeys(found):
            table = _object_at(address)
            if isinstance(table, dict) and table.get(probe) is probe:
                return address
        raise LayoutError("no interned-string table found in the interpreter's data")

    def counts(self) -> Counts:
        head = self._read(self.address, 48)
        assert head is not None
        _refcnt, _type, used, _version, keys, _values = struct.unpack("<qQqQQQ", head)
        raw = self._read(keys, 32)
        assert raw is not None
        _dk_refcnt, log2_size, _log2_index_bytes, _kind, _pad, _dk_version, usable, entries = struct.unpack("<qBBBBIqq", raw)
        return Counts(used=used, entries=entries, usable=usable, log2_size=log2_size)

    def _check(self) -> None:
        """The layout read is 3.11's: the counters agree with Python's own view of the table."""
        table = _object_at(self.address)
        before = self.counts()
        fresh = sys.intern(f"interned-check-{uuid.uuid4().hex}")
        after = self.counts()
        slots = 1 << after.log2_size
        ok = (
            before.used == len(table) - 1
            and after.used == len(table)
            and after.entries + after.usable == (slots << 1) // 3
            and after.entries >= after.used
            and (after.entries == before.entries + 1 or after.log2_size != before.log2_size)
        )
        del fresh
        if not ok:
            raise LayoutError(f"the interned table's counters are not CPython 3.11's: {before} then {after}, len {len(table)}")


def _object_at(address: int) -> object:
    import ctypes

    return ctypes.cast(address, ctypes.py_object).value
