"""The profile's SQLite database, migrated by one temporary Prefect server at a time.

A flow run without ``PREFECT_API_URL`` starts a temporary Prefect server on the
profile's SQLite database, and the server migrates the database as it starts. Prefect's
lock around its migrations holds within one process only: scripts started together on
a new database, or on the first night after a Prefect upgrade, each migrate it, and a
server that meets another's migration (``table … already exists``) exits and is started
again, on a busy host after Prefect's wait for it has passed, so its flow run fails
before it begins.

So where a flow script's runner finds that database behind Prefect's latest migration as
the runner is made, its process holds a lock on a file beside the database while
Prefect starts the temporary server there, and so while that server migrates it. Scripts
started with it wait for the lock before starting theirs, find the database migrated,
and start their servers side by side. A script alone starts its server as Prefect
would. On a migrated database, as on every other night, making the runner reads one
row of it. ``PREFECT_GPU_DASK_MIGRATION_LOCK=false`` leaves the servers to meet.
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

OPT_OUT = "PREFECT_GPU_DASK_MIGRATION_LOCK"
LOCK_SUFFIX = ".migration-lock"
LOCK_WAIT_S = 600.0  # a process holding it longer is stuck: this one's server migrates as Prefect's would
LOCK_POLL_S = 0.05
SAY_WAIT_AFTER_S = 1.0

# Under Prefect's logger: its console handler shows the migration to whoever ran the script.
logger = logging.getLogger("prefect.prefect_gpu_dask")


def migrate_one_server_at_a_time() -> None:
    """As a flow script makes its runner: where the temporary server this process would
    start would find its database behind Prefect's latest migration, have Prefect start
    that server inside ``one_migration_at_a_time``."""
    if os.environ.get(OPT_OUT, "true").strip().lower() in ("0", "false", "no", "off"):
        return
    path = temporary_server_database()
    if path is not None and not is_migrated(path):
        _compat.around_ephemeral_server_start(one_migration_at_a_time)


@contextlib.contextmanager
def one_migration_at_a_time() -> Iterator[bool]:
    """Around the start of a temporary server: where its database is behind Prefect's
    latest migration, hold the lock beside it until the server has started, and so has
    migrated it. Yields whether this process's server migrates it; where another's did
    meanwhile, the lock goes at once and the servers start side by side."""
    path = temporary_server_database()
    if path is None or is_migrated(path):
        yield False
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(path.name + LOCK_SUFFIX)
    with contextlib.ExitStack() as held:
        try:
            waited_s = held.enter_context(_held(lock))
        except TimeoutError:
            logger.warning(
                "Another process held %s for %.0f s: this temporary server migrates the database beside it",
                lock,
                LOCK_WAIT_S,
            )
            yield False
            return
        if is_migrated(path):
            held.close()
            if waited_s >= SAY_WAIT_AFTER_S:
                logger.info("Waited %.1f s while another process's server migrated %s", waited_s, path)
            yield False
            return
        logger.info(
            "Prefect's database %s is not at this Prefect's latest migration: its temporary server "
            "migrates it while flow runs starting beside it wait",
            path,
        )
        started = time.monotonic()
        yield True
        logger.info(
            "Migrated Prefect's database %s as its server started, in %.1f s",
            path,
            time.monotonic() - started,
        )


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
