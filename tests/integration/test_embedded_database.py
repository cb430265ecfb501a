"""The profile's SQLite database, migrated by one of the temporary servers that start on
it together while the others wait (``flow/embedded_database.py``), with real Prefect
servers and real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import prefect.server.database
from alembic.script import ScriptDirectory

from benchmarks.probes import night_start
from prefect_gpu_dask.flow import embedded_database

ROOT = Path(__file__).resolve().parents[2]


def test_the_migration_graph_read_from_prefects_scripts_is_alembics():
    root = Path(prefect.server.database.__file__).parent / "_migrations"
    alembic = ScriptDirectory(str(root), version_locations=[str(root / "versions" / "sqlite")])
    revisions, heads = embedded_database.migrations()
    assert heads == set(alembic.get_heads())
    assert revisions == {s.revision for s in alembic.walk_revisions()}


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
    start inside the migration lock."""
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


START_A_SERVER = textwrap.dedent(
    """
    import sys
    import time
    from pathlib import Path

    from prefect.logging.configuration import setup_logging
    from prefect.server.api.server import SubprocessASGIServer

    from prefect_gpu_dask.flow import embedded_database

    setup_logging()  # Prefect's console logging, as in a flow script
    embedded_database.lock_migrating_server_starts()  # as making a runner does
    ready, everyone = Path(sys.argv[1]), int(sys.argv[2])
    ready.touch()
    while len(list(ready.parent.glob("ready-*"))) < everyone:  # all of them at once
        time.sleep(0.01)
    server = SubprocessASGIServer()
    try:
        server.start(timeout=float(sys.argv[3]))
    except RuntimeError as exc:
        print("did not start:", exc.__class__.__name__, "running" if server.server_process else "stopped")
    else:
        server.stop()
    """
)


def start_servers(home: Path, count: int, timeout_s: float = 150) -> list[str]:
    """``count`` processes that each make a runner, then start a temporary server at the
    same moment; their outputs."""
    env = embedded_env(home)
    barrier = Path(tempfile.mkdtemp(dir=home.parent, prefix="barrier-"))
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", START_A_SERVER, str(barrier / f"ready-{i}"), str(count), str(timeout_s)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(count)
    ]
    try:
        outputs = [p.communicate(timeout=280)[0] for p in processes]
    finally:
        for p in processes:  # none left behind with its server, whatever happened
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in processes] == [0] * count, "\n".join(o[-2000:] for o in outputs)
    return outputs


def test_temporary_servers_starting_together_on_a_new_database_migrate_it_one_at_a_time(tmp_path):
    home = tmp_path / "home"
    outputs = start_servers(home, 3)
    for output in outputs:
        for clash in night_start.MIGRATION_CLASH:
            assert clash not in output, output[-3000:]
    assert sum(embedded_database.MIGRATED in output for output in outputs) == 1, outputs
    assert any("while another process's server migrated" in output for output in outputs), outputs
    assert embedded_database.migration_state(home / "prefect.db") == "latest"


def test_a_server_that_does_not_start_in_time_is_stopped_before_the_lock_goes(tmp_path):
    """Its migration must not run on beside the next server's; that next one migrates."""
    home = tmp_path / "home"
    [output] = start_servers(home, 1, timeout_s=0.5)
    assert "did not start: RuntimeError stopped" in output, output[-3000:]
    [output] = start_servers(home, 1)
    assert embedded_database.MIGRATED in output, output[-3000:]
    assert embedded_database.migration_state(home / "prefect.db") == "latest"


def test_a_lock_that_cannot_be_had_leaves_the_server_to_start_as_prefects_would(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / f"prefect.db{embedded_database.LOCK_SUFFIX}").mkdir()  # not a file: cannot be opened as one
    [output] = start_servers(home, 1)
    assert "Could not lock" in output, output[-3000:]
    assert embedded_database.migration_state(home / "prefect.db") == "latest"
