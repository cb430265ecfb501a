"""Real servers for the tests: Debian's PostgreSQL on 127.0.0.1, and a
``prefect server start`` on loopback backed by it (or by SQLite).

Both are processes of their own, stopped on exit. PostgreSQL refuses to run as root,
so as root it runs as the ``postgres`` system user the Debian package creates.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from benchmarks.servers import server_process

PG_BIN_DIRS = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def postgres_missing() -> str | None:
    """Why a PostgreSQL-backed Prefect server cannot run here, or None if it can."""
    if not any((d / "initdb").exists() for d in PG_BIN_DIRS):
        return "PostgreSQL is not installed (Debian's postgresql package: /usr/lib/postgresql/*/bin)"
    if os.geteuid() == 0:
        try:
            import pwd

            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run PostgreSQL as"
    try:
        import asyncpg  # noqa: F401
    except ImportError:
        return "asyncpg (Prefect's PostgreSQL driver) is not installed"
    return None


def _as_postgres(args: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *args] if os.geteuid() == 0 else args


@contextlib.contextmanager
def postgres_server() -> Iterator[str]:
    """A fresh PostgreSQL cluster on 127.0.0.1; yields its SQLAlchemy URL for Prefect."""
    bin_dir = next(d for d in PG_BIN_DIRS if (d / "initdb").exists())
    root = Path(tempfile.mkdtemp(prefix="pg-"))
    data = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    port = free_port()
    run = dict(check=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    subprocess.run(
        _as_postgres(
            [str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "prefect", "-E", "UTF8"]
        ),
        **run,
    )
    options = f"-h 127.0.0.1 -p {port} -k {root} -c max_connections=200 -c fsync=off"
    subprocess.run(
        _as_postgres(
            [str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start"]
        ),
        **run,
    )
    try:
        subprocess.run(
            _as_postgres(
                [str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "prefect", "prefect"]
            ),
            **run,
        )
        yield f"postgresql+asyncpg://prefect@127.0.0.1:{port}/prefect"
    finally:
        subprocess.run(
            _as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        shutil.rmtree(root, ignore_errors=True)


def migrated_sqlite(path: Path) -> None:
    """Put a SQLite database already migrated by this Prefect at ``path``.

    It is a copy of a template that ``prefect server database upgrade`` builds once per
    Prefect version and machine (test processes share it, under a lock), so a server
    started on it skips the migrations, which are most of its start on 2 cores.
    """
    import fcntl
    import hashlib
    import sqlite3

    import prefect.server.database

    migrations = Path(prefect.server.database.__file__).parent / "_migrations" / "versions" / "sqlite"
    tag = hashlib.sha256("\n".join(sorted(p.name for p in migrations.glob("*.py"))).encode()).hexdigest()
    root = Path(tempfile.gettempdir()) / f"prefect-gpu-dask-sqlite-{prefect.__version__}-{tag[:12]}"
    root.mkdir(exist_ok=True)
    template = root / "prefect.db"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not template.exists():
            building = root / f"building-{os.getpid()}.db"
            subprocess.run(
                [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                env={
                    **os.environ,
                    "PREFECT_HOME": str(root),
                    "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{building}",
                },
                check=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            with contextlib.closing(sqlite3.connect(building)) as db:
                db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # all of it in the one file
            os.replace(building, template)
    shutil.copyfile(template, path)


SQLITE_FILES: dict[str, Path] = {}  # API URL -> the SQLite file of a server started here


@contextlib.contextmanager
def prefect_server(database_url: str | None = None, timeout: float = 180) -> Iterator[str]:
    """``prefect server start`` on 127.0.0.1 (on ``database_url``, else on a migrated
    SQLite copy in a temp dir); yields its API URL once ``/api/health`` answers (started
    again on another port where its port was taken: ``benchmarks.servers.server_process``)."""
    home = Path(tempfile.mkdtemp(prefix="prefect-home-"))
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": database_url or f"sqlite+aiosqlite:///{home / 'prefect.db'}",
    }
    if database_url is None:
        migrated_sqlite(home / "prefect.db")
        env["PREFECT_SERVER_DATABASE_MIGRATE_ON_START"] = "false"
    url = ""
    try:
        with server_process(env, home, timeout) as url:
            if database_url is None:
                SQLITE_FILES[url] = home / "prefect.db"
            yield url
    finally:
        SQLITE_FILES.pop(url, None)
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def using_prefect_server(database_url: str | None = None) -> Iterator[str]:
    """A ``prefect_server`` that this process's flows use, through the settings context;
    their events and logs reach it before it stops."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # Prefect keys its events worker on the client type, not the API URL: one started for
    # another server would carry this one's events, so each server gets a fresh one.
    EventsWorker.drain_all()
    with prefect_server(database_url) as api, temporary_settings({PREFECT_API_URL: api}):
        try:
            yield api
        finally:
            EventsWorker.drain_all()
            APILogWorker.drain_all()
