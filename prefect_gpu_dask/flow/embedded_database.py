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
import functools
import logging
import os
import re
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

from prefect_gpu_dask import _compat
from prefect_gpu_dask.switches import switched_on

OPT_OUT = "PREFECT_GPU_DASK_MIGRATION_LOCK"
LOCK_SUFFIX = ".migration-lock"
# A process holding the lock longer than its server may take to start is stuck: this
# one's server then migrates as Prefect's would.
LOCK_WAIT_MARGIN_S = 600.0
LOCK_POLL_S = 0.05
SAY_WAIT_AFTER_S = 1.0
MIGRATED = "Migrated Prefect's database"  # what the process whose server migrated it logs

# Under Prefect's logger: its console handler shows the migration to whoever ran the script.
logger = logging.getLogger("prefect.prefect_gpu_dask")


def lock_migrating_server_starts() -> None:
    """As a flow script makes its runner: where the temporary server this process would
    start would find its database behind Prefect's latest migration, have Prefect start
    that server inside ``one_migration_at_a_time``."""
    if not enabled():
        return
    path = temporary_server_database()
    if path is not None and migration_state(path) == "behind":
        _compat.around_ephemeral_server_start(one_migration_at_a_time)


def enabled() -> bool:
    return switched_on(OPT_OUT)


@contextlib.contextmanager
def one_migration_at_a_time() -> Iterator[bool]:
    """Around the start of a temporary server: where its database is behind Prefect's
    latest migration, hold the lock beside it until the server has started, and so has
    migrated it. Yields whether this process's server migrates it; where another's did
    meanwhile, the lock goes at once and the servers start side by side. Where the lock
    cannot be had (a file system without ``flock``, a lock file not readable here), the
    server starts as Prefect's would."""
    path: Path | None = None
    try:
        path = temporary_server_database()
        behind = path is not None and migration_state(path) == "behind"
    except Exception as exc:  # settings not readable here: Prefect's server says what is wrong
        logger.debug("Could not read which database the temporary server migrates: %r", exc)
        behind = False
    if path is None or not behind:
        yield False
        return
    lock = path.with_name(path.name + LOCK_SUFFIX)
    with contextlib.ExitStack() as held:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            waited_s = held.enter_context(_held(lock, _lock_wait_s()))
        except (TimeoutError, OSError) as exc:
            logger.warning(
                "Could not lock %s (%r): the temporary server migrates the database beside others", lock, exc
            )
            yield False
            return
        if migration_state(path) != "behind":
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
        logger.info("%s %s as its server started, in %.1f s", MIGRATED, path, time.monotonic() - started)


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


def migration_state(path: Path) -> str:
    """``"latest"``: the database at ``path`` is at this Prefect's latest migration;
    ``"behind"``: it is not, does not exist yet, or cannot be read now (a lock then costs
    at most a wait); ``"unknown"``: a revision this Prefect does not have (a newer
    Prefect's), or Prefect's migrations are not readable here, which leaves the servers
    to Prefect."""
    try:
        revisions, heads = migrations()
    except Exception as exc:
        logger.debug("Could not read Prefect's migrations: %r", exc)
        return "unknown"
    try:
        at = revision(path)
    except (sqlite3.Error, OSError) as exc:
        logger.debug("Could not read which migration %s is at: %r", path, exc)
        return "behind"
    if at in heads:
        return "latest"
    return "behind" if at is None or at in revisions else "unknown"


@functools.cache  # read once per process: a runner is made again for every flow run
def migrations() -> tuple[frozenset[str], frozenset[str]]:
    """Every revision of this Prefect's SQLite migrations, and its heads (those no other
    migration follows)."""
    return migration_graph(_compat.prefect_sqlite_migrations())


_REVISION = re.compile(r"^revision\s*(?::[^=\n]*)?=\s*[\"']([^\"']+)[\"']", re.MULTILINE)
_DOWN_REVISION = re.compile(r"^down_revision\s*(?::[^=\n]*)?=\s*(\([^)]*\)|\[[^\]]*\]|[^\n]*)", re.MULTILINE)
_QUOTED = re.compile(r"[\"']([^\"']+)[\"']")


def migration_graph(versions: Path) -> tuple[frozenset[str], frozenset[str]]:
    """The revisions of the alembic scripts in ``versions``, and their heads, from each
    script's ``revision`` and ``down_revision`` as alembic writes them (plain or typed,
    a merge's parents in a tuple or list on one line or several). Alembic's own
    ``ScriptDirectory`` imports every script, and Prefect's server with them."""
    revisions: set[str] = set()
    followed: set[str] = set()
    for script in sorted(versions.glob("*.py")):
        text = script.read_text(encoding="utf-8")
        found = _REVISION.findall(text)
        if len(found) != 1:
            raise LookupError(f"{script}: {len(found)} revision lines")
        revisions.add(found[0])
        if down := _DOWN_REVISION.search(text):
            followed.update(_QUOTED.findall(down.group(1)))
    heads = revisions - followed
    if not heads:
        raise LookupError(f"no migrations read from {versions}")
    return frozenset(revisions), frozenset(heads)


def revision(path: Path | str) -> str | None:
    """The migration the SQLite database at ``path`` is at; None where there is no
    database or none of Prefect's tables yet. Nothing is created: where no server has it
    open (no write-ahead log or journal beside it) it is opened as immutable, since a
    read-only open of a database in WAL mode would leave ``-shm`` and ``-wal`` files
    behind, owned by whoever ran this; otherwise read-only, through the log's existing
    files, so that writes still in the log are seen."""
    file = Path(path).resolve()
    if not file.exists():
        return None
    in_use = Path(f"{file}-wal").exists() or Path(f"{file}-journal").exists()
    mode = "ro" if in_use else "ro&immutable=1"
    with contextlib.closing(sqlite3.connect(f"{file.as_uri()}?mode={mode}", uri=True)) as db:
        try:
            row = db.execute("SELECT version_num FROM alembic_version").fetchone()
        except sqlite3.OperationalError as exc:
            if "no such table" in str(exc):
                return None
            raise
    return row[0] if row else None


def _lock_wait_s() -> float:
    """As long as another process's server may take to start, and a margin."""
    from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

    return PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value() + LOCK_WAIT_MARGIN_S


@contextlib.contextmanager
def _held(lock: Path, wait_s: float) -> Iterator[float]:
    """Hold an exclusive lock on the file ``lock``; yields the seconds waited for it.
    Raises ``TimeoutError`` after ``wait_s``. The lock goes with the process, however it
    ends. Opened read-only: a lock file another user made is enough to read."""
    import fcntl

    fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        started = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - started > wait_s:
                    raise TimeoutError(lock) from None
                time.sleep(LOCK_POLL_S)
        try:
            yield time.monotonic() - started
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
