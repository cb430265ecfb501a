"""The profile's SQLite database, migrated by one process at a time before Prefect's
temporary servers start on it.

A flow run without ``PREFECT_API_URL`` starts a temporary Prefect server on the
profile's SQLite database, and the server migrates the database as it starts. Prefect's
lock around its migrations holds within one process only: scripts started together on
a new database, or on the first night after a Prefect upgrade, each migrate it, and a
server that meets another's migration (``table … already exists``) exits and is started
again, on a busy host after Prefect's wait for it has passed, so its flow run fails
before it begins.

So where a flow script's runner finds that database behind Prefect's latest migration as
the runner is made, its process migrates the database just before Prefect starts the
temporary server there, holding a lock on a file beside the database. Scripts started
with it wait for that lock, find the database migrated, and start their servers side by
side. On a migrated database, as on every other night, making the runner reads one row
of it. ``PREFECT_GPU_DASK_MIGRATE_FIRST=false`` leaves the migrations to each server.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

from prefect_gpu_dask import _compat

OPT_OUT = "PREFECT_GPU_DASK_MIGRATE_FIRST"
LOCK_SUFFIX = ".migration-lock"
LOCK_WAIT_S = 600.0  # a process holding it longer is stuck: its server migrates as Prefect's would
LOCK_POLL_S = 0.05
SAY_WAIT_AFTER_S = 1.0

# Under Prefect's logger: its console handler shows the migration to whoever ran the script.
logger = logging.getLogger("prefect.prefect_gpu_dask")


def migrate_before_the_server_starts() -> None:
    """As a flow script makes its runner: where the temporary server this process would
    start would find its database behind Prefect's latest migration, migrate the
    database in this process when Prefect is about to start that server, one process at
    a time (``migrate_first``)."""
    if os.environ.get(OPT_OUT, "true").strip().lower() in ("0", "false", "no", "off"):
        return
    path = temporary_server_database()
    if path is not None and not is_migrated(path):
        _compat.before_ephemeral_server_starts(migrate_first)


def migrate_first() -> bool:
    """Migrate the database Prefect's temporary server is about to start on, unless
    another process has by the time this one holds the lock. Returns whether this
    process migrated it."""
    path = temporary_server_database()
    if path is None:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(path.name + LOCK_SUFFIX)
    try:
        with _held(lock) as waited_s:
            if is_migrated(path):
                if waited_s >= SAY_WAIT_AFTER_S:
                    logger.info("Waited %.1f s while another process migrated %s", waited_s, path)
                return False
            logger.info("Migrating Prefect's database %s before its temporary server starts", path)
            started = time.monotonic()
            _compat.upgrade_prefect_database()
            logger.info("Migrated Prefect's database %s in %.1f s", path, time.monotonic() - started)
            return True
    except TimeoutError:
        logger.warning(
            "Another process held %s for %.0f s: Prefect's temporary server migrates the database itself",
            lock,
            LOCK_WAIT_S,
        )
        return False


def temporary_server_database() -> Path | None:
    """The SQLite file a temporary Prefect server started here would migrate; None where
    none would start (``PREFECT_API_URL`` is set, temporary servers are off), where it
    would not migrate at start, or where its database is not a file."""
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        return None
    database = settings.server.database
    if not database.migrate_on_start or database.connection_url is None:
        return None
    return sqlite_file(database.connection_url.get_secret_value())


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite database URL; None for other databases and in-memory ones."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    name = parsed.database or ""
    if parsed.get_backend_name() != "sqlite" or not name or name == ":memory:" or name.startswith("file:"):
        return None
    return Path(name)


def is_migrated(path: Path) -> bool:
    """Whether the database at ``path`` is at this Prefect's latest migration; True where
    that cannot be read (Prefect's own servers then migrate it, as without this module)."""
    try:
        return revision(path) in _compat.sqlite_migration_heads()
    except Exception as exc:
        logger.debug("Could not read whether %s is migrated: %r", path, exc)
        return True


def revision(path: Path | str) -> str | None:
    """The migration the SQLite database at ``path`` is at; None where there is no
    database or none of Prefect's tables yet. Nothing is created: with no write-ahead log
    beside it (no server has it open) it is opened as immutable, since a read-only open of
    a database in WAL mode would leave ``-shm`` and ``-wal`` files behind, owned by
    whoever ran this; with one, read-only, through the log's existing files, so that
    writes still in the log are seen."""
    file = Path(path).resolve()
    if not file.exists():
        return None
    mode = "ro" if Path(f"{file}-wal").exists() else "ro&immutable=1"
    with contextlib.closing(sqlite3.connect(f"{file.as_uri()}?mode={mode}", uri=True)) as db:
        try:
            row = db.execute("SELECT version_num FROM alembic_version").fetchone()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return None
            raise
    return row[0] if row else None


@contextlib.contextmanager
def _held(lock: Path) -> Iterator[float]:
    """Hold an exclusive lock on the file ``lock``; yields the seconds waited for it.
    Raises ``TimeoutError`` after ``LOCK_WAIT_S``. The lock goes with the process, however
    it ends."""
    with open(lock, "a") as file:
        started = time.monotonic()
        while True:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - started > LOCK_WAIT_S:
                    raise TimeoutError(lock) from None
                time.sleep(LOCK_POLL_S)
        try:
            yield time.monotonic() - started
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)
