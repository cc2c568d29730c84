"""A structural walk of every live page of LMDB's ``data.mdb``, in Python, before liblmdb maps the file.

Why: liblmdb trusts the pages it maps. A node whose size runs past its page, a branch entry pointing at a page past
the file end, an overflow run longer than the file, a bad ``mp_lower`` — each makes the reading process read
through the map past what the file holds (SIGBUS), past the map (SIGSEGV), or trip an ``assert`` (SIGABRT), with no
Python frame left to raise an error. This module reads the file with ``os.pread`` (never ``mmap``: a file shrunk
under a map is exactly the SIGBUS this exists to prevent) and walks, from the meta page LMDB would pick, the free
list tree, the main tree, every named sub-database's tree (``F_SUBDATA`` records of the main tree), every dupsort
value set (``F_DUPDATA`` sub-pages inside leaf nodes, or ``F_DUPDATA|F_SUBDATA`` nested trees), checking on each
page what liblmdb relies on without checking:

* the page number field equals the page's position, no page is reached twice (no cycles, no shared pages), and every
  page number lies in ``[2, mm_last_pg]`` (page 0 and 1 are the metas) and inside the file (which may end before
  ``mm_last_pg``: LMDB counts pages it allocated and freed again unwritten);
* the flags are exactly a page kind liblmdb writes to disk (branch, leaf, leaf2 of a dupfixed value set, overflow;
  ``P_DIRTY`` on disk would make a writer modify the read-only map in place);
* ``16 <= mp_lower <= mp_upper <= page size``, ``mp_lower`` even, at least one key (two on a branch page outside the
  free list: liblmdb asserts it), every node offset in ``[mp_upper, page size)`` and even, every node's header, key
  and (inline) data inside the page, node flags a combination that tree kind can hold;
* an ``F_BIGDATA`` value's overflow run: the page there is an overflow page of that number, the run lies inside
  ``mm_last_pg`` and holds the value's length;
* every leaf at the depth its ``MDB_db`` record says (and branches above it), the record's entry count equal to the
  values found, an empty record (root ``P_INVALID``) all zero;
* every page number the free list names lies in the file and is not also a live page.

Layout facts (64-bit liblmdb 0.9, little-endian), ported from ``mdb.c`` — not its code: a page starts with a
16-byte header ``mp_pgno u64 | mp_pad u16 | mp_flags u16 | mp_lower u16 | mp_upper u16`` (an overflow page has
``mp_pages u32`` at 12 instead of lower/upper), then ``mp_ptrs``: one u16 node offset per key. A node is ``mn_lo u16 |
mn_hi u16 | mn_flags u16 | mn_ksize u16 | key | data``; in a leaf the data size is ``lo | hi << 16`` (8 bytes of
overflow page number when ``F_BIGDATA``), in a branch the child page is ``lo | hi << 16 | flags << 32`` and no data
follows. A leaf2 page (``MDB_DUPFIXED`` value sets) holds ``mp_pad``-byte keys back to back after the header. An
``MDB_db`` record is 48 bytes: ``md_pad u32 | md_flags u16 | md_depth u16 | branch, leaf, overflow pages u64 |
md_entries u64 | md_root u64``.

What this cannot see: damage that keeps every structure valid (a flipped key byte, a value's bytes — kvshelf seals
its records for that), and damage made after the walk (a check at open covers the file as it was at open).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from ...errors import CorruptData

P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_DIRTY, P_LEAF2, P_SUBP = 0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MDB_REVERSEKEY, MDB_DUPSORT, MDB_INTEGERKEY, MDB_DUPFIXED = 0x02, 0x04, 0x08, 0x10
PAGEHDRSZ, NODESIZE, DB_SIZE = 16, 8, 48
P_INVALID = (1 << 64) - 1
CURSOR_STACK = 32  # liblmdb's deepest cursor: a deeper tree is not one it wrote
_HDR = struct.Struct("<QHHHH")
_NODE = struct.Struct("<HHHH")
_DB = struct.Struct("<IHHQQQQQ")
_U64 = struct.Struct("<Q")
_ODD = int.from_bytes(b"\x01" * (1 << 15), "little")  # the low bit of every node offset's low byte
# the tree kinds a walk meets, and the node flags a leaf of each may hold
MAIN, NAMED, DUPS, FREE = "main", "named", "dups", "free"
_LEAF_FLAGS = {MAIN: (0, F_BIGDATA, F_SUBDATA), NAMED: (0, F_BIGDATA), DUPS: (0,), FREE: (0, F_BIGDATA)}


class PageDamage(CorruptData):
    """What the walk found wrong, in the walk's words (``lmdbcheck`` adds the file and the way back)."""


class Db:
    """An ``MDB_db`` record, decoded."""

    __slots__ = ("pad", "flags", "depth", "branch", "leaf", "overflow", "entries", "root")

    def __init__(self, raw: bytes, offset: int = 0) -> None:
        (self.pad, self.flags, self.depth, self.branch, self.leaf, self.overflow, self.entries,
         self.root) = _DB.unpack_from(raw, offset)


class Walk:
    """One walk over a database of ``npages`` pages (``mm_last_pg + 1``) of ``psize`` bytes, of which the file holds
    ``fpages`` — fewer when the last pages were allocated and freed again without ever being written, which LMDB
    does; only a live page past the file's end is damage. ``read(pgno, count)`` returns those pages'
    bytes (shorter only when the file is). ``pages`` counts the pages read, ``free`` the free-list entries."""

    def __init__(self, read: Callable[[int, int], bytes], psize: int, npages: int, fpages: int) -> None:
        self.read, self.psize, self.npages, self.fpages = read, psize, npages, min(npages, fpages)
        self.seen = bytearray(self.fpages)
        self.free: list[int] = []
        self.pages = 0

    # ------------------------------------------------------------------------------------------ entry points
    def run(self, free_db: Db, main_db: Db) -> None:
        """Walk the free list and the main tree (and through it every named and nested tree); ``PageDamage``."""
        self.tree(free_db, FREE, "the free list")
        self.tree(main_db, MAIN, "the main database")
        seen = self.seen
        for pgno in self.free:
            if pgno < 2 or pgno >= self.npages:
                raise PageDamage(f"the free list names page {pgno}, outside pages 2..{self.npages - 1}")
            if pgno >= self.fpages:
                continue  # never written: nothing live can be there
            if seen[pgno]:
                raise PageDamage(f"page {pgno} is both free and " +
                                 ("in use" if seen[pgno] == 1 else "named twice by the free list"))
            seen[pgno] = 2

    def tree(self, db: Db, kind: str, what: str) -> None:
        """Every page of the tree ``db`` describes, checked; its record's depth and entry count too."""
        if db.root == P_INVALID:
            if db.depth or db.entries or db.branch or db.leaf or db.overflow:
                raise PageDamage(f"{what} is empty (no root page) but its record says depth {db.depth}, "
                                 f"{db.entries} entries")
            return
        if not 1 <= db.depth <= CURSOR_STACK:
            raise PageDamage(f"{what} has depth {db.depth}")
        if kind == DUPS and db.flags & ~(MDB_DUPFIXED | MDB_INTEGERKEY | MDB_REVERSEKEY):
            raise PageDamage(f"{what} has flags {db.flags:#x}, not those of a dupsort value set")
        leaf2 = kind == DUPS and bool(db.flags & MDB_DUPFIXED)
        entries = 0
        stack = [(db.root, 1)]
        while stack:
            pgno, depth = stack.pop()
            page = self._page(pgno, what)
            flags = _HDR.unpack_from(page)[2]
            if depth < db.depth:
                if flags != P_BRANCH:
                    raise PageDamage(f"page {pgno} of {what} at depth {depth} of {db.depth} is not a branch page "
                                     f"(flags {flags:#x})")
                stack.extend((child, depth + 1) for child in self._branch(page, pgno, kind, what))
            else:
                want = (P_LEAF | P_LEAF2) if leaf2 else P_LEAF
                if flags != want:
                    raise PageDamage(f"page {pgno} of {what} at depth {depth} (its leaf level) has flags "
                                     f"{flags:#x}, not {want:#x}")
                entries += self._leaf2(page, 0, len(page), f"page {pgno} of {what}") if leaf2 else \
                    self._leaf(page, pgno, kind, db, what)
        if entries != db.entries:
            raise PageDamage(f"{what} holds {entries} entries, its record says {db.entries}")

    # ------------------------------------------------------------------------------------------ pages
    def _page(self, pgno: int, what: str) -> bytes:
        if not 2 <= pgno < self.npages:
            raise PageDamage(f"{what} refers to page {pgno}, outside pages 2..{self.npages - 1}")
        if pgno >= self.fpages:
            raise PageDamage(f"page {pgno} of {what} lies past the end of the file ({self.fpages} pages): truncated")
        if self.seen[pgno]:
            raise PageDamage(f"page {pgno} is reached twice (last from {what})")
        self.seen[pgno] = 1
        self.pages += 1
        page = self.read(pgno, 1)
        if len(page) < self.psize:
            raise PageDamage(f"page {pgno} of {what} lies past the end of the file")
        if _HDR.unpack_from(page)[0] != pgno:
            raise PageDamage(f"page {pgno} of {what} carries page number {_HDR.unpack_from(page)[0]}")
        return page

    def _ptrs(self, page: bytes, base: int, end: int, where: str) -> tuple[int, ...]:
        """The node offsets (relative to ``base``) of the (sub-)page at ``base`` ending at ``end``, each checked to
        lie in ``[mp_upper, end - NODESIZE]`` and be even (a node header fits; liblmdb keeps nodes 2-aligned)."""
        _pg, _pad, _flags, lower, upper = _HDR.unpack_from(page, base)
        size = end - base
        if lower < PAGEHDRSZ or lower & 1 or lower > upper or upper > size:
            raise PageDamage(f"{where} has lower {lower} / upper {upper} (a page of {size} bytes)")
        n = (lower - PAGEHDRSZ) >> 1
        ptrs = struct.unpack_from(f"<{n}H", page, base + PAGEHDRSZ)
        if n and (min(ptrs) < upper or max(ptrs) > size - NODESIZE):
            raise PageDamage(f"{where} has a node offset outside {upper}..{size - NODESIZE}")
        if n and int.from_bytes(page[base + PAGEHDRSZ:base + lower:2], "little") & _ODD:
            raise PageDamage(f"{where} has an odd node offset")
        return ptrs

    def _branch(self, page: bytes, pgno: int, kind: str, what: str) -> list[int]:
        where = f"branch page {pgno} of {what}"
        ptrs = self._ptrs(page, 0, self.psize, where)
        if len(ptrs) < (1 if kind == FREE else 2):  # liblmdb asserts two (the free list may hold one mid-rebalance)
            raise PageDamage(f"{where} has {len(ptrs)} keys")
        children = []
        limit, unpack = self.psize - NODESIZE, _NODE.unpack_from
        for p in ptrs:
            lo, hi, flags, ksize = unpack(page, p)
            if p + ksize > limit:
                raise PageDamage(f"{where}: a key of {ksize} bytes at {p} runs past the page")
            children.append(lo | hi << 16 | flags << 32)
        return children

    def _leaf(self, page: bytes, pgno: int, kind: str, db: Db, what: str) -> int:
        """Check a leaf page's nodes (following named trees, value sets and overflow runs); its entry count."""
        where = f"leaf page {pgno} of {what}"
        ptrs = self._ptrs(page, 0, self.psize, where)
        if not ptrs:
            raise PageDamage(f"{where} has no keys")
        dupsort = kind in (MAIN, NAMED) and bool(db.flags & MDB_DUPSORT)
        allowed = (0, F_DUPDATA, F_DUPDATA | F_SUBDATA) if dupsort else _LEAF_FLAGS[kind]
        limit, unpack, entries, plain = self.psize - NODESIZE, _NODE.unpack_from, 0, kind != FREE
        for p in ptrs:
            lo, hi, flags, ksize = unpack(page, p)
            if plain and not flags:  # the common node, checked in the fewest steps
                if p + ksize + (lo | hi << 16) > limit:
                    raise PageDamage(f"{where}: the node at {p} ({ksize}-byte key, {lo | hi << 16}-byte value) "
                                     f"runs past the page")
                entries += 1
                continue
            dsize, data = lo | hi << 16, p + NODESIZE + ksize
            if flags not in allowed:
                raise PageDamage(f"{where}: a node at {p} has flags {flags:#x}, not one of {allowed}")
            if kind == FREE and ksize != 8:
                raise PageDamage(f"{where}: a free-list key of {ksize} bytes (not 8)")
            if data + (8 if flags & F_BIGDATA else dsize) > self.psize:
                raise PageDamage(f"{where}: the node at {p} ({ksize}-byte key, {dsize}-byte value) runs past "
                                 f"the page")
            value = self._overflow(page, data, dsize, where, kind == FREE) if flags & F_BIGDATA else None
            if flags & F_SUBDATA:
                if dsize != DB_SIZE:
                    raise PageDamage(f"{where}: a sub-database record of {dsize} bytes (not {DB_SIZE})")
                sub = Db(page, data)
                if flags & F_DUPDATA:
                    self.tree(sub, DUPS, f"a value set in {what}")
                    entries += sub.entries
                else:
                    name = bytes(page[p + NODESIZE:data]).decode("utf-8", "replace")
                    self.tree(sub, NAMED, f"sub-database {name!r}")
                    entries += 1
            elif flags & F_DUPDATA:
                entries += self._subpage(page, data, dsize, db, f"a value sub-page in {where}")
            else:
                entries += 1
                if kind == FREE:
                    self._free_ids(page[data:data + dsize] if value is None else value, where)
        return entries

    def _subpage(self, page: bytes, base: int, size: int, db: Db, where: str) -> int:
        """A dupsort value set held inside a leaf node (``P_SUBP``): its own little page of ``size`` bytes."""
        if size < PAGEHDRSZ:
            raise PageDamage(f"{where}: {size} bytes, shorter than a page header")
        flags = _HDR.unpack_from(page, base)[2] & ~P_DIRTY  # liblmdb sets P_DIRTY on sub-pages too
        want = P_LEAF | P_SUBP | (P_LEAF2 if db.flags & MDB_DUPFIXED else 0)
        if flags != want:
            raise PageDamage(f"{where} has flags {flags:#x}, not {want:#x}")
        if want & P_LEAF2:
            return self._leaf2(page, base, base + size, where)
        ptrs = self._ptrs(page, base, base + size, where)
        if not ptrs:
            raise PageDamage(f"{where} has no values")
        for p in ptrs:
            lo, hi, nflags, ksize = _NODE.unpack_from(page, base + p)
            if nflags or p + NODESIZE + ksize + (lo | hi << 16) > size:
                raise PageDamage(f"{where}: the value at {p} (flags {nflags:#x}, {ksize} bytes) runs past it")
        return len(ptrs)

    def _leaf2(self, page: bytes, base: int, end: int, where: str) -> int:
        """A leaf2 page (fixed-size values back to back, their size in ``mp_pad``); its value count."""
        _pg, ksize, _flags, lower, upper = _HDR.unpack_from(page, base)
        n = (lower - PAGEHDRSZ) >> 1
        if lower < PAGEHDRSZ + 2 or lower & 1 or lower > upper or upper > end - base or not ksize or \
                base + PAGEHDRSZ + n * ksize > end:
            raise PageDamage(f"{where}: {n} values of {ksize} bytes (lower {lower} / upper {upper}) do not fit")
        return n

    def _overflow(self, page: bytes, at: int, dsize: int, where: str, want: bool) -> bytes | None:
        """Check the overflow run a ``F_BIGDATA`` node names; its value when ``want`` (the free list reads its own)."""
        pgno = _U64.unpack_from(page, at)[0]
        if not 2 <= pgno < self.npages:
            raise PageDamage(f"{where}: a value on overflow page {pgno}, outside pages 2..{self.npages - 1}")
        head = self.read(pgno, 1)
        if len(head) < self.psize:
            raise PageDamage(f"{where}: overflow page {pgno} lies past the end of the file")
        number, _pad, flags, count = struct.unpack_from("<QHHI", head)
        if number != pgno or flags != P_OVERFLOW:
            raise PageDamage(f"{where}: overflow page {pgno} carries number {number}, flags {flags:#x}")
        if count < 1 or pgno + count > self.fpages or count * self.psize - PAGEHDRSZ < dsize:
            raise PageDamage(f"{where}: an overflow run of {count} pages at {pgno} for {dsize} bytes "
                             f"(the file holds {self.fpages} of the {self.npages} pages)")
        if self.seen.find(b"\x01", pgno, pgno + count) != -1:
            raise PageDamage(f"{where}: overflow pages {pgno}..{pgno + count - 1} are reached twice")
        self.seen[pgno:pgno + count] = b"\x01" * count
        self.pages += count
        return self.read(pgno, count)[PAGEHDRSZ:PAGEHDRSZ + dsize] if want else None

    def _free_ids(self, value: bytes, where: str) -> None:
        """A free-list record: ``count u64`` then that many page numbers (the record may be roomier than needed)."""
        if len(value) < 8 or len(value) & 7:
            raise PageDamage(f"{where}: a free-list record of {len(value)} bytes")
        count = _U64.unpack_from(value)[0]
        if count > len(value) // 8 - 1:
            raise PageDamage(f"{where}: a free-list record claims {count} pages in {len(value)} bytes")
        self.free.extend(struct.unpack_from(f"<{count}Q", value, 8))


__all__ = ["PageDamage", "Db", "Walk", "P_INVALID"]
