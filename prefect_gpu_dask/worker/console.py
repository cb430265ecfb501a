"""Prefect's console log lines on a worker process, written plainly where rich would
write them without colour.

Prefect's console handler renders every line through ``rich``, on the thread that logs
it: on a worker, the task run's own thread, while it holds its ``gpu`` slot. Where rich
writes no colour (the stream is not a terminal, and nothing forces colour) and markup is
off (Prefect's default), ``logging.StreamHandler`` writes the same line, with the same
format, level and filters, for a fraction of the time
(``benchmarks/probes/console_lines.py``). Rich would also expand tabs and ``:emoji:``
codes and drop control characters; the plain handler writes them as they are. A
terminal keeps Prefect's handler and its colours.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import IO, Any


class PlainConsoleHandler(logging.StreamHandler):
    """Writes what the Prefect console handler it stands in for would, without rich."""


def is_terminal(stream: IO[str] | Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def writes_plain_text(handler: Any) -> bool:
    """Whether a Prefect console handler writes no colour and no markup."""
    from prefect.settings import PREFECT_LOGGING_MARKUP

    console = getattr(handler, "console", None)
    return (
        not is_terminal(handler.stream)
        and console is not None
        and console.color_system is None
        and not PREFECT_LOGGING_MARKUP.value()
    )


def plain_handler(rich_handler: logging.StreamHandler) -> PlainConsoleHandler:
    """A ``PlainConsoleHandler`` writing what ``rich_handler`` writes, to its stream."""
    plain = PlainConsoleHandler(rich_handler.stream)
    plain.set_name(rich_handler.get_name())
    plain.setLevel(rich_handler.level)
    plain.setFormatter(rich_handler.formatter)
    for log_filter in rich_handler.filters:
        plain.addFilter(log_filter)
    return plain


def all_loggers() -> list[logging.Logger]:
    # A snapshot first: another thread may create a logger meanwhile.
    known = list(logging.Logger.manager.loggerDict.values())
    return [logging.getLogger()] + [logger for logger in known if isinstance(logger, logging.Logger)]


def write_plainly_where_unseen(loggers: Iterable[logging.Logger] | None = None) -> int:
    """Swap each Prefect console handler of ``loggers`` (default: all of this process's)
    that writes plain text for a plain handler (one per Prefect handler, shared as that
    one was); the number of loggers changed."""
    from prefect.logging.handlers import PrefectConsoleHandler

    swapped = 0
    plain: dict[int, PlainConsoleHandler] = {}
    for logger in all_loggers() if loggers is None else loggers:
        for handler in list(logger.handlers):
            if isinstance(handler, PrefectConsoleHandler) and writes_plain_text(handler):
                replacement = plain.setdefault(id(handler), plain_handler(handler))
                logger.addHandler(replacement)  # added first: no line is lost in between
                logger.removeHandler(handler)
                swapped += 1
    return swapped
