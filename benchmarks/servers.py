"""The Prefect servers the benchmarks report to, each a process of its own on 127.0.0.1:
``prefect server start`` on SQLite in a temp dir or on Debian's PostgreSQL, started here.

PostgreSQL refuses to run as root, so as root it runs as the ``postgres`` system user the
Debian package creates (``benchmarks/gpu_run.sh`` makes one where it unpacks the pack).
"""

from __future__ import annotations

import contextlib
import http.client
import itertools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

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

    def pg(*args: str, **kwargs: Any) -> None:
        subprocess.run(
            _as_postgres([str(bin_dir / args[0]), *args[1:]]),
            **({"check": True, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT} | kwargs),
        )

    pg("initdb", "-D", str(data), "-A", "trust", "-U", "prefect", "-E", "UTF8")
    options = f"-h 127.0.0.1 -p {port} -k {root} -c max_connections=200 -c fsync=off"
    pg("pg_ctl", "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start")
    try:
        pg("createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "prefect", "prefect")
        yield f"postgresql+asyncpg://prefect@127.0.0.1:{port}/prefect"
    finally:
        pg("pg_ctl", "-D", str(data), "-m", "immediate", "-w", "stop", check=False, stdout=subprocess.DEVNULL)
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def prefect_server(
    database_url: str | None = None, timeout: float = 180, home: Path | None = None
) -> Iterator[str]:
    """``prefect server start`` on 127.0.0.1 (on ``database_url``, else on SQLite at
    ``home / "prefect.db"``, migrated as it starts); yields its API URL once ``/api/health``
    answers. ``home``: its ``PREFECT_HOME`` (a new temp dir by default), removed when it stops."""
    home = home if home is not None else Path(tempfile.mkdtemp(prefix="prefect-home-"))
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_DATABASE_CONNECTION_URL": database_url or f"sqlite+aiosqlite:///{home / 'prefect.db'}",
    }
    try:
        with server_process(env, home, timeout) as url:
            yield url
    finally:
        shutil.rmtree(home, ignore_errors=True)


@contextlib.contextmanager
def server_process(env: dict[str, str], home: Path, timeout: float) -> Iterator[str]:
    """``prefect server start`` with ``env`` on a free port of 127.0.0.1, its log at
    ``home / "server.log"``; yields its API URL once ``/api/health`` answers, and stops it.

    The free port may be taken before the server binds it (by a Dask process, say): then
    it starts again on another port, three times at most."""
    env = {name: value for name, value in env.items() if name != "PREFECT_API_URL"}
    logs: list[IO[str]] = []
    proc: subprocess.Popen | None = None
    try:
        deadline = time.monotonic() + timeout
        for attempt in itertools.count(1):
            port = free_port()
            if attempt > 1:  # the one that found its port taken keeps its log beside
                (home / "server.log").rename(home / f"server-port-taken-{attempt - 1}.log")
            logs.append(log := open(home / "server.log", "w"))
            command = ["prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
            proc = subprocess.Popen(
                [sys.executable, "-m", *command],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            url = f"http://127.0.0.1:{port}/api"
            if _healthy(proc, url, deadline, Path(log.name)):
                break
            _stop(proc)
            if attempt == 3:
                raise RuntimeError(f"prefect server found its port taken {attempt} times")
        yield url
    finally:
        if proc is not None:
            _stop(proc)
        for log in logs:
            log.close()


def _healthy(proc: subprocess.Popen, url: str, deadline: float, log: Path) -> bool:
    """True once the server at ``url`` answers its health check; False where another
    process holds its port; raises where it exited or timed out otherwise."""
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
                if answer.status == 200:
                    return True
        except http.client.RemoteDisconnected:  # closed without an answer: still starting
            pass
        except http.client.HTTPException:  # an answer that is not HTTP: another process's port
            return False
        except OSError:
            pass
        if proc.poll() is not None:
            if "address already in use" in log.read_text().lower():
                return False
            raise RuntimeError(f"prefect server did not start (exited): {log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"prefect server did not start (timed out): {log.read_text()[-2000:]}")
        time.sleep(0.25)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()  # nothing it holds is kept: a short grace, then kill
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def using_prefect_server(database_url: str | None = None, home: Path | None = None) -> Iterator[str]:
    """A ``prefect_server`` (its ``PREFECT_HOME`` at ``home``) that this process's flows
    use, through the settings context; their events and logs reach it before it stops."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, temporary_settings

    # Prefect keys its events worker on the client type, not the API URL: one started for
    # another server would carry this one's events, so each server gets a fresh one.
    EventsWorker.drain_all()
    with prefect_server(database_url, home=home) as api, temporary_settings({PREFECT_API_URL: api}):
        try:
            yield api
        finally:
            EventsWorker.drain_all()
            APILogWorker.drain_all()


def on_postgres(measure: Callable[[], Any]) -> Any:
    """``measure()`` with this process's flows reporting to ``prefect server start`` on
    PostgreSQL (the production set-up); ``{"skipped": why}`` where that cannot run."""
    if (why := postgres_missing()) is not None:
        return {"skipped": why}
    with contextlib.ExitStack() as servers:
        try:
            database = servers.enter_context(postgres_server())
            servers.enter_context(using_prefect_server(database))
        except (subprocess.CalledProcessError, RuntimeError) as exc:
            return {"skipped": f"PostgreSQL or its Prefect server did not start: {exc}"}
        return measure()
