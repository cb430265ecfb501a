"""Task runs' console lines on worker processes of their own: written plainly where the
worker's output is a file, still written, still sent to the API; the flow's process
keeps Prefect's handlers."""

from __future__ import annotations

import logging
import time
import uuid

from prefect import flow, get_run_logger, task

from prefect_gpu_dask import GPUDaskTaskRunner
from tests.conftest import task_run_logs


def console_handler_types() -> set[str]:
    return {
        type(handler).__name__
        for logger in [logging.getLogger()] + list(logging.Logger.manager.loggerDict.values())
        if isinstance(logger, logging.Logger)
        for handler in logger.handlers
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
    }


@task(tags=["gpu"])
def says(line: str) -> tuple[set[str], str]:
    from prefect.runtime import task_run

    get_run_logger().info(line)
    return console_handler_types(), task_run.id


def test_a_workers_console_lines_are_written_plainly_to_its_file(remote_cluster):
    line = f"a line of {uuid.uuid4().hex}"

    @flow(task_runner=GPUDaskTaskRunner(address=remote_cluster.address))
    def speaks() -> tuple[set[str], str]:
        return says.submit(line).result()

    on_the_worker, task_run_id = speaks()

    assert "PlainConsoleHandler" in on_the_worker and "PrefectConsoleHandler" not in on_the_worker
    flows_own = [type(handler).__name__ for handler in logging.getLogger().handlers]
    assert "PrefectConsoleHandler" in flows_own, "the flow's process keeps Prefect's"
    assert task_run_logs(task_run_id, containing=line)  # and the API has the line
    log = remote_cluster.tmp / "worker-gpu-worker.log"
    deadline = time.monotonic() + 10
    while line not in log.read_text():
        assert time.monotonic() < deadline, "the line never reached the worker's output"
        time.sleep(0.1)
    (written,) = [text for text in log.read_text().splitlines() if line in text]
    assert "| INFO    | Task run 'says-" in written, written
