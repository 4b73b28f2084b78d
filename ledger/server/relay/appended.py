"""The rows this process just appended, handed to the relay instead of read back.

The relay follows the event log by position. Most of what it reads, this very
process appended a moment before, and still holds: reading it back cost a query
per relay turn (on PostgreSQL about 0.4 ms of the event loop's CPU each, more
than one per operation at a moderate rate). `AppendedRows` keeps the rows of the
last appends, as stored (position, originator ID, version, topic, state), and
serves them when they are provably everything that follows the relay's
position; otherwise the relay reads the table as before.

The proof is contiguity. Positions are unique and, while an append holds the
events table's lock (SQLite's single writer; the EXCLUSIVE lock of
`ledger.adapters.recorders`), no lower position can be committed after a higher
one. So if the kept rows start at exactly `position + 1` and have no gap, no
other row can lie between them: not another instance's, not one written by
hand. Any gap (another writer's rows, IDs a failed transaction used up) and the
kept rows are dropped and the table is read.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from itertools import islice, pairwise

from ledger.adapters.event_tables import StoredRow

__all__ = ["AppendedRows"]


class AppendedRows:
    """The last rows this process appended, served to the relay when they provably
    follow its position (see the module docstring); else `read` is asked."""

    def __init__(
        self,
        read: Callable[[int, int], Sequence[StoredRow]],
        *,
        kept: int = 2_000,
        kept_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        self._read = read
        self._kept = kept
        # Bounded in bytes too: an event's state may hold a proposal's arguments
        # (up to 256 KiB), and 2,000 of those would be half a gigabyte.
        self._kept_bytes = kept_bytes
        self._rows: deque[StoredRow] = deque()
        self._bytes = 0
        # Appends may come from another thread than the relay's reads.
        self._lock = threading.Lock()
        self.served = 0
        """Rows handed to the relay without a read (for tests)."""
        self.reads = 0
        """Reads of the table (for tests)."""

    def add(self, rows: Sequence[StoredRow]) -> None:
        """Rows one append just stored (committed), in position order."""
        if not rows:
            return
        with self._lock:
            kept = self._rows
            if kept and rows[0][0] != kept[-1][0] + 1:
                # A gap: rows someone else stored in between, or positions a failed
                # transaction used up. The relay reads the table past it.
                self._clear()
            if any(later[0] != earlier[0] + 1 for earlier, later in pairwise(rows)):
                self._clear()
                return
            size = sum(len(row[4]) for row in rows)
            if len(kept) + len(rows) > self._kept or self._bytes + size > self._kept_bytes:
                # Nobody takes them (another instance relays, or the relay is
                # stopped): memory stays bounded and the relay reads when it comes.
                self._clear()
                if len(rows) > self._kept or size > self._kept_bytes:
                    return
            kept.extend(rows)
            self._bytes += size

    def rows_after(self, position: int, limit: int) -> Sequence[StoredRow]:
        """Up to `limit` stored rows after `position`, in position order: the kept rows
        if they start right after it, else read from the table."""
        with self._lock:
            kept = self._rows
            while kept and kept[0][0] <= position:
                # Published, or another instance's relay got past them.
                self._bytes -= len(kept.popleft()[4])
            if kept and kept[0][0] == position + 1:
                self.served += min(len(kept), limit)
                return list(islice(kept, limit))
            self._clear()  # they do not follow: read past them
            self.reads += 1
        return self._read(position, limit)

    def forget(self) -> None:
        """Another writer appended (its notice came): rows of its may follow the kept ones,
        where contiguity cannot see them, so the next read is the table's."""
        with self._lock:
            self._clear()

    @property
    def kept(self) -> tuple[int, int]:
        """The rows kept and their states' bytes (for tests)."""
        with self._lock:
            return len(self._rows), self._bytes

    def _clear(self) -> None:
        self._rows.clear()
        self._bytes = 0
