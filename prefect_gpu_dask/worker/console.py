"""Prefect's console log lines on a worker process, written plainly where no terminal shows them.

Prefect's console handler renders every line through ``rich``, on the thread that logs
it: on a worker, the task run's own thread, while it holds its ``gpu`` slot. Where the
handler's stream is not a terminal (a file, a pipe, a service's journal) rich writes no
colour, and ``logging.StreamHandler`` writes the same line, with the same format, level
and filters, for a fraction of the time (``benchmarks/probes/console_lines.py``). A
terminal keeps Prefect's handler and its colours.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import IO, Any


def is_terminal(stream: IO[str] | Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class PlainConsoleHandler(logging.StreamHandler):
    """Writes what the Prefect console handler it stands in for would, without rich."""


def plain_handler(rich_handler: logging.StreamHandler) -> PlainConsoleHandler:
    """A ``PlainConsoleHandler`` writing what ``rich_handler`` writes, to its stream."""
    plain = PlainConsoleHandler(rich_handler.stream)
    plain.setLevel(rich_handler.level)
    plain.setFormatter(rich_handler.formatter)
    for log_filter in rich_handler.filters:
        plain.addFilter(log_filter)
    return plain


def all_loggers() -> list[logging.Logger]:
    return [logging.getLogger()] + [
        logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]


def write_plainly_where_unseen(loggers: Iterable[logging.Logger] | None = None) -> int:
    """Swap each Prefect console handler of ``loggers`` (default: all of this process's)
    whose stream is not a terminal for a plain one; the number swapped."""
    from prefect.logging.handlers import PrefectConsoleHandler

    swapped = 0
    for logger in all_loggers() if loggers is None else loggers:
        for handler in list(logger.handlers):
            if isinstance(handler, PrefectConsoleHandler) and not is_terminal(handler.stream):
                logger.removeHandler(handler)
                logger.addHandler(plain_handler(handler))
                swapped += 1
    return swapped
