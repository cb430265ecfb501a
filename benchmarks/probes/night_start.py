"""Flow scripts started together on the README default, as a night's cron starts them:
each starts a temporary Prefect server of its own on one SQLite database
(``PREFECT_HOME``), then runs ``--tasks`` ``gpu``-tagged task runs on a CPU cluster of
its own. Per variant and trial: how many scripts ended 0, how many servers met another's
migration (and were started again by Prefect), and each script's time from the first
one's start to its own end.

Variants: ``fresh`` (a new database) or ``migrated`` (``prefect server database upgrade
-y`` first, as ``prefect-gpu-dask doctor`` advises), each with Prefect's default 20 s for
a temporary server to start or with 120 s; with ``--migration-lock both``, each trial
runs once as the package is (one script's server migrates a new database while the
others wait to start theirs) and once with ``PREFECT_GPU_DASK_MIGRATION_LOCK=false``
(every server migrates it as it starts), in turn.

    python benchmarks/probes/night_start.py --scripts 4 --tasks 200 --trials 2 --out night.json
    python benchmarks/probes/night_start.py --variants fresh:20 --migration-lock both --trials 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from prefect_gpu_dask.flow import embedded_database

ROOT = Path(__file__).resolve().parents[2]
# What a server that met another's migration logs before it exits (alembic, SQLite).
MIGRATION_CLASH = ("already exists", "duplicate column", "No such constraint", "expected to match one row")
SCRIPT = textwrap.dedent(
    """
    import sys
    import time

    from prefect import flow, task

    from prefect_gpu_dask import GPUDaskTaskRunner


    @task(tags=["gpu"])
    def step(i: int) -> int:
        return i


    @flow(task_runner=GPUDaskTaskRunner(
        host_cluster=False,
        cluster_kwargs={"n_workers": 1, "threads_per_worker": 4, "resources": {"GPU": 4}},
    ))
    def nightly(n: int) -> int:
        return sum(f.result() for f in step.map(range(n)))


    if __name__ == "__main__":
        n = int(sys.argv[1])
        assert nightly(n) == n * (n - 1) // 2
    """
)
VARIANTS = "fresh:20,fresh:120,migrated:20,migrated:120"
# What a script's process logs where its server migrated the database, holding the lock.
MIGRATED = embedded_database.MIGRATED


def script_env(home: Path, startup_s: int, migration_lock: bool = True) -> dict[str, str]:
    """The environment of a script on the README default with ``home`` as its Prefect
    home: no API URL or database of another's, its server logging each 503 it answers."""
    elsewhere = ("PREFECT_API_URL", "PREFECT_API_DATABASE", "PREFECT_SERVER_DATABASE")
    env = {k: v for k, v in os.environ.items() if not k.startswith(elsewhere)}
    return env | {
        "PREFECT_GPU_DASK_MIGRATION_LOCK": str(migration_lock).lower(),
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": str(startup_s),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # Each server then logs every request it answers 503 (its output is the script's).
        "PREFECT_API_LOG_RETRYABLE_ERRORS": "true",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }


def migrate(env: dict[str, str]) -> None:
    """``prefect server database upgrade -y`` on the database ``env`` names."""
    upgrade = [sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"]
    subprocess.run(upgrade, env=env, capture_output=True, check=True, timeout=300)


def trial(database: str, startup_s: int, migration_lock: bool, scripts: int, tasks: int, work: Path) -> dict:
    env = script_env(Path(tempfile.mkdtemp(dir=work)), startup_s, migration_lock)
    if database == "migrated":
        migrate(env)
    script = work / "nightly.py"
    script.write_text(SCRIPT)
    started = time.perf_counter()
    runs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tasks)],
            env=env,
            cwd=work,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(scripts)
    ]
    ended: list[tuple[int, float, str]] = [(-1, 0.0, "")] * scripts

    def wait(index: int) -> None:  # a thread each: every script's own end
        try:
            log = runs[index].communicate(timeout=900)[1]
        except subprocess.TimeoutExpired:
            runs[index].kill()
            log = runs[index].communicate()[1] + "\n(killed after 900 s)"
        ended[index] = (runs[index].returncode, time.perf_counter() - started, log)

    waiters = [threading.Thread(target=wait, args=(i,)) for i in range(scripts)]
    for waiter in waiters:
        waiter.start()
    for waiter in waiters:
        waiter.join()
    return {
        "database": database,
        "startup_timeout_s": startup_s,
        "migration_lock": migration_lock,
        "migrated_by_a_script": sum(MIGRATED in log for _, _, log in ended),
        "ended_0": sum(code == 0 for code, _, _ in ended),
        "timed_out_starting": sum("Timed out while attempting to connect" in log for _, _, log in ended),
        "migration_clashes": sum(any(c in log for c in MIGRATION_CLASH) for _, _, log in ended),
        "answers_503": sum(log.count("Encountered retryable exception in request") for _, _, log in ended),
        "wall_s": [round(wall, 1) for _, wall, _ in ended],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--variants", default=VARIANTS, help="database:startup seconds, comma-separated")
    parser.add_argument("--migration-lock", choices=("on", "off", "both"), default="on")
    args = parser.parse_args()
    variants = [(name, int(seconds)) for name, seconds in (v.split(":") for v in args.variants.split(","))]
    locks = {"on": [True], "off": [False], "both": [False, True]}[args.migration_lock]
    results = []
    with tempfile.TemporaryDirectory() as work:
        for database, startup_s in variants:
            for _ in range(args.trials):
                for lock in locks:  # in turn, trial by trial
                    results.append(trial(database, startup_s, lock, args.scripts, args.tasks, Path(work)))
    print(f"# {args.scripts} scripts at once, {args.tasks} gpu-tagged task runs each, {os.cpu_count()} cores")
    print(
        "| database | startup wait | migration lock | ended 0 | timed out starting | met a migration "
        "| migrated by a script | 503 | median s |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['database']} | {r['startup_timeout_s']} s | {'on' if r['migration_lock'] else 'off'} | "
            f"{r['ended_0']}/{args.scripts} | {r['timed_out_starting']} | {r['migration_clashes']} | "
            f"{r['migrated_by_a_script']} | {r['answers_503']} | {statistics.median(r['wall_s']):.1f} |"
        )
    if args.out:
        out = {"scripts": args.scripts, "tasks": args.tasks, "cores": os.cpu_count(), "trials": results}
        args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
