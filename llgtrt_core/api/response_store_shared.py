"""The stored responses shared by the API workers of one server (`server.api_workers` > 1).

A client's next request may land on any worker, so the responses are rows of one SQLite file in
the workers' private folder (server_files.py), named after the server: any worker finds, continues,
deletes or cancels a response another one stored. An entry is pickled (its pydantic models come
back exactly; the folder is private to this user). WAL mode: readers never wait for a writer, and
a write holds the lock briefly, so the calls run on the event loop: a store takes ~0.1 ms with
another process writing, its p99 (0.8-1.4 ms) and worst (4-8 ms) those of a 0.1 ms pure-Python
spin on the same loaded 2-core box (bench/response_store.py).

A cancel marks the response's row; each worker, while it runs stored responses, looks for marked
rows every CANCEL_POLL_S (one query for all of them) and stops its own at their next token. The
running worker's next store of the response sees the mark too, so a cancel never loses to the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import sqlite3
import time
import weakref
from typing import Callable, Iterator, Optional

from llgtrt_core.api.response_store import StoredResponse
from llgtrt_core.server_files import remove_stale_server_files, server_file_path

logger = logging.getLogger(__name__)

CANCEL_POLL_S = 0.1
_BUSY_TIMEOUT_S = 10.0  # another worker's write lasts well under a millisecond
_WAL_SWITCH_RETRY_S = 0.002
_FILE_STEM = "responses"
# The rowid orders the rows by their last store: INSERT OR REPLACE gives the row a new, largest one.
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    stored_at REAL NOT NULL,
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    entry BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_age ON responses (stored_at);
CREATE INDEX IF NOT EXISTS responses_to_cancel ON responses (id) WHERE cancel_requested = 1;
"""


class SharedResponseStore:
    def __init__(self, max_size: int, ttl_s: float, path: Optional[str] = None,
                 clock: Callable[[], float] = time.time):
        """path: the SQLite file; None: this server's, found on first use (the app is built at
        import, also in the `bentoml serve` process, which must not make one)."""
        self.max_size = max_size
        self.ttl_s = ttl_s
        self._path = path
        self._clock = clock  # wall time: the workers compare each other's
        self._db: Optional[sqlite3.Connection] = None
        # The responses this worker runs, gone with their requests even if one never ends well.
        self._running: weakref.WeakValueDictionary[str, StoredResponse] = weakref.WeakValueDictionary()
        self._poller: Optional[asyncio.Task] = None

    def put(self, entry: StoredResponse) -> None:
        if self.max_size <= 0:
            return
        response = entry.response
        with self._transaction() as db:
            marked = db.execute("SELECT 1 FROM responses WHERE id = ? AND cancel_requested = 1",
                                (response.id,)).fetchone()
            if marked:  # cancelled in another worker before this one saw it
                entry.cancel()
            entry.stored_at = self._clock()
            db.execute("INSERT OR REPLACE INTO responses (id, stored_at, entry) VALUES (?, ?, ?)",
                       (response.id, entry.stored_at, _dump(entry)))
            db.execute("DELETE FROM responses WHERE stored_at < ?", (entry.stored_at - self.ttl_s,))
            db.execute("DELETE FROM responses WHERE rowid <= "
                       "(SELECT rowid FROM responses ORDER BY rowid DESC LIMIT 1 OFFSET ?)", (self.max_size,))
        if response.status == "in_progress":
            self._watch(entry)
        else:
            self._running.pop(response.id, None)

    def get(self, response_id: str) -> Optional[StoredResponse]:
        row = self._connection().execute("SELECT entry, stored_at FROM responses WHERE id = ? AND stored_at >= ?",
                                         (response_id, self._oldest_kept())).fetchone()
        return None if row is None else _load(*row)

    def delete(self, response_id: str) -> bool:
        deleted = self._connection().execute("DELETE FROM responses WHERE id = ? AND stored_at >= ?",
                                             (response_id, self._oldest_kept()))
        return deleted.rowcount > 0

    def cancel(self, response_id: str) -> Optional[StoredResponse]:
        with self._transaction() as db:
            row = db.execute("SELECT entry, stored_at FROM responses WHERE id = ? AND stored_at >= ?",
                             (response_id, self._oldest_kept())).fetchone()
            if row is None:
                return None
            entry = _load(*row)
            if entry.response.status != "in_progress":
                return entry
            entry.cancel()  # the copy stored; the worker running it stops at the mark
            db.execute("UPDATE responses SET cancel_requested = 1, entry = ? WHERE id = ?",
                       (_dump(entry), response_id))
        running = self._running.get(response_id)
        if running is not None:  # it runs here: no need to wait for the poll
            running.cancel()
        return entry

    def _watch(self, entry: StoredResponse) -> None:
        self._running[entry.response.id] = entry
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_cancels())

    async def _poll_cancels(self) -> None:
        """While this worker runs stored responses: stop those cancelled in another worker."""
        while self._running:
            await asyncio.sleep(CANCEL_POLL_S)
            try:
                marked = self._connection().execute("SELECT id FROM responses WHERE cancel_requested = 1").fetchall()
            except sqlite3.Error:
                logger.exception("could not look for cancelled responses")
                continue
            for (response_id,) in marked:
                entry = self._running.get(response_id)
                if entry is not None:
                    entry.cancel()

    def _oldest_kept(self) -> float:
        return self._clock() - self.ttl_s

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        db = self._connection()
        db.execute("BEGIN IMMEDIATE")  # the write lock now: the read inside decides the write
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            path = self._path
            if path is None:
                remove_stale_server_files(_FILE_STEM)  # left by servers that crashed
                path = server_file_path(_FILE_STEM, ".sqlite3")
            db = sqlite3.connect(path, timeout=_BUSY_TIMEOUT_S, isolation_level=None)
            _switch_to_wal(db)
            db.execute("PRAGMA synchronous=OFF")  # the file dies with the server: no fsync needed
            db.executescript(_SCHEMA)
            self._db = db
        return self._db


def _switch_to_wal(db: sqlite3.Connection) -> None:
    """SQLite takes the lock for this switch without the busy timeout: while another worker's first
    connection switches the new file, it answers "database is locked" at once. Wait for that one."""
    deadline = time.monotonic() + _BUSY_TIMEOUT_S
    while True:
        try:
            db.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(_WAL_SWITCH_RETRY_S)


def _dump(entry: StoredResponse) -> bytes:
    return pickle.dumps((entry.response, entry.input_items), protocol=pickle.HIGHEST_PROTOCOL)


def _load(data: bytes, stored_at: float) -> StoredResponse:
    response, input_items = pickle.loads(data)
    return StoredResponse(response, input_items, stored_at=stored_at)
