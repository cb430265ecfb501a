"""Prefect's console lines on a worker: written plainly, the same text, where no
terminal shows them; a terminal keeps Prefect's handler."""

from __future__ import annotations

import io
import logging
import os

import pytest
from prefect.logging.formatters import PrefectFormatter
from prefect.logging.handlers import PrefectConsoleHandler

from prefect_gpu_dask.worker.console import PlainConsoleHandler, is_terminal, write_plainly_where_unseen

TASK_RUN_FORMAT = "%(asctime)s.%(msecs)03d | %(levelname)-7s | Task run %(task_run_name)r - %(message)s"


@pytest.fixture(autouse=True)
def no_handlers_left_behind():
    """This process's other tests look at its console handlers."""
    yield
    for name in ("test-console.prefect", "test-console.plain", "test-console.terminal"):
        logging.getLogger(name).handlers.clear()


def prefect_console(stream, name: str) -> logging.Logger:
    """A logger with a console handler as Prefect's logging.yml configures task runs'."""
    handler = PrefectConsoleHandler(stream=stream, level="INFO")
    handler.setFormatter(PrefectFormatter(format=TASK_RUN_FORMAT, datefmt="%H:%M:%S"))
    handler.addFilter(lambda record: "secret" not in record.getMessage())
    logger = logging.getLogger(name)
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.handlers[:] = [handler]
    return logger


def emit_lines(logger: logging.Logger) -> None:
    extra = {"task_run_name": "noop-1a2"}
    logger.info("GPU memory on GPU-0 (#0): before 1.0 GiB, after 1.0 GiB -> clean", extra=extra)
    logger.debug("not at this level", extra=extra)
    logger.info("a secret line", extra=extra)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("Task run failed", extra=extra)


def test_a_console_no_terminal_shows_gets_the_same_lines_plainly():
    as_prefect, plain = io.StringIO(), io.StringIO()
    emit_lines(prefect_console(as_prefect, "test-console.prefect"))
    logger = prefect_console(plain, "test-console.plain")

    assert write_plainly_where_unseen([logger]) == 1
    (handler,) = logger.handlers
    assert type(handler) is PlainConsoleHandler and handler.level == logging.INFO
    emit_lines(logger)

    written = plain.getvalue()
    assert "noop-1a2" in written and "RuntimeError: boom" in written and "secret" not in written
    assert "not at this level" not in written
    # The same lines but for their times.
    strip_times = lambda text: [line[12:] if line[:2].isdigit() else line for line in text.splitlines()]  # noqa: E731
    assert strip_times(written) == strip_times(as_prefect.getvalue())
    assert write_plainly_where_unseen([logger]) == 0  # done once


def test_markup_keeps_prefects_handler():
    from prefect.settings import PREFECT_LOGGING_MARKUP, temporary_settings

    with temporary_settings({PREFECT_LOGGING_MARKUP: True}):
        logger = prefect_console(io.StringIO(), "test-console.plain")
        assert write_plainly_where_unseen([logger]) == 0
    assert isinstance(logger.handlers[0], PrefectConsoleHandler)


def test_a_terminal_keeps_prefects_handler():
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as terminal:
        assert is_terminal(terminal)
        logger = prefect_console(terminal, "test-console.terminal")
        assert write_plainly_where_unseen([logger]) == 0
        assert isinstance(logger.handlers[0], PrefectConsoleHandler)
    os.close(leader)
    assert not is_terminal(terminal)  # closed
    assert not is_terminal(object())
