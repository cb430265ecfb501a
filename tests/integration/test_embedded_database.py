"""The profile's SQLite database, migrated by one of the temporary servers that start on
it together while the others wait (``flow/embedded_database.py``), with real Prefect
servers and real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import prefect.server.database
from alembic.script import ScriptDirectory

from benchmarks.probes import night_start
from prefect_gpu_dask import _compat
from prefect_gpu_dask.flow import embedded_database

ROOT = Path(__file__).resolve().parents[2]


def test_the_heads_read_from_prefects_migration_files_are_alembics():
    root = Path(prefect.server.database.__file__).parent / "_migrations"
    alembic = ScriptDirectory(str(root), version_locations=[str(root / "versions" / "sqlite")])
    assert _compat.sqlite_migration_heads() == set(alembic.get_heads())


def embedded_env(home: Path, **extra: str) -> dict[str, str]:
    """A process on the README default with ``home`` as its Prefect home."""
    elsewhere = ("PREFECT_API_URL", "PREFECT_API_DATABASE", "PREFECT_SERVER_DATABASE", "PREFECT_GPU_DASK")
    env = {k: v for k, v in os.environ.items() if not k.startswith(elsewhere)}
    return env | {"PREFECT_HOME": str(home), "PYTHONPATH": str(ROOT), **extra}


MAKE_A_RUNNER = textwrap.dedent(
    """
    from prefect.server.api.server import SubprocessASGIServer
    from prefect_gpu_dask import GPUDaskTaskRunner

    GPUDaskTaskRunner(cluster_kwargs={"processes": False})  # threads: no fork server to start
    print(getattr(SubprocessASGIServer.start, "started_inside", None) is not None)
    """
)


def runner_made(home: Path, **extra: str) -> bool:
    """Make a runner in a fresh process; whether Prefect's temporary server would now
    have the database migrated first."""
    done = subprocess.run(
        [sys.executable, "-c", MAKE_A_RUNNER],
        env=embedded_env(home, **extra),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1] == "True"


def test_making_the_runner_creates_nothing_and_hooks_only_a_temporary_server_on_a_new_database(tmp_path):
    home = tmp_path / "home"
    assert runner_made(home)
    assert not (home / "prefect.db").exists()  # migrated only as a temporary server starts

    assert not runner_made(home, PREFECT_API_URL="http://127.0.0.1:9/api")  # no temporary server
    assert not runner_made(home, PREFECT_GPU_DASK_MIGRATION_LOCK="false")
    assert not (home / "prefect.db").exists()


START_A_SERVER_AT = textwrap.dedent(
    """
    import sys
    import time

    from prefect.logging.configuration import setup_logging
    from prefect.server.api.server import SubprocessASGIServer

    from prefect_gpu_dask.flow import embedded_database

    setup_logging()  # Prefect's console logging, as in a flow script
    embedded_database.migrate_one_server_at_a_time()  # as making a runner does
    time.sleep(max(0.0, float(sys.argv[1]) - time.time()))  # all of them at once
    server = SubprocessASGIServer()
    server.start(timeout=150)
    server.stop()
    """
)


def test_temporary_servers_starting_together_on_a_new_database_migrate_it_one_at_a_time(tmp_path):
    home = tmp_path / "home"
    env = embedded_env(home)
    start_at = time.time() + 10  # past every process's imports, on 2 busy cores too
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", START_A_SERVER_AT, str(start_at)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=280)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0, 0], "\n".join(o[-2000:] for o in outputs)
    for output in outputs:
        for clash in night_start.MIGRATION_CLASH:
            assert clash not in output, output[-3000:]
    assert sum(night_start.MIGRATED in output for output in outputs) == 1, outputs  # the others waited
    assert embedded_database.revision(home / "prefect.db") in _compat.sqlite_migration_heads()
