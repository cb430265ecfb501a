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

The plain handler formats each line on the thread that logs it and writes it from a
thread of its own: a write is a system call, and the task run's thread, returning from
it, would wait for the GIL behind the worker's other threads while it holds its slot.
"""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import queue
import threading
import weakref
from collections.abc import Iterable
from typing import IO, Any

# How long flushing waits for the writer thread (at exit: the lines still queued).
FLUSH_TIMEOUT_S = 5.0


class PlainConsoleHandler(logging.StreamHandler):
    """Writes what the Prefect console handler it stands in for would, without rich:
    formatted where it is logged, written in order by a daemon thread ("console")."""

    def __init__(self, stream: IO[str] | None = None):
        super().__init__(stream)
        self._lines: queue.SimpleQueue[str | threading.Event] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._start_lock = threading.Lock()
        # A process forked from this one (a task's own multiprocessing) has no writer.
        handler = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (h := handler()) is not None and h._forget_writer())

    def _forget_writer(self) -> None:
        self._lines = queue.SimpleQueue()  # the parent's lines are the parent's to write
        self._writer = None
        self._start_lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + self.terminator
        except Exception:
            self.handleError(record)
            return
        self._lines.put(line)
        if self._writer is None:
            self._start_writer()

    def flush(self) -> None:
        """Return once every line logged before has been written (or after a while)."""
        if self._writer is None or not self._writer.is_alive():
            return
        written = threading.Event()
        self._lines.put(written)
        written.wait(FLUSH_TIMEOUT_S)

    def _start_writer(self) -> None:
        with self._start_lock:
            if self._writer is not None:
                return
            self._writer = threading.Thread(target=self._write, name="console", daemon=True)
            self._writer.start()
        # A worker process ends through multiprocessing, which runs no atexit hooks
        # (logging's flush among them) but its own finalizers.
        multiprocessing.util.Finalize(self, self.flush, exitpriority=0)

    def _write(self) -> None:
        while True:
            text: list[str] = []
            item = self._lines.get()
            while True:  # what was queued meanwhile goes in the same write
                if isinstance(item, threading.Event):
                    self._write_out(text)
                    text = []
                    item.set()
                else:
                    text.append(item)
                try:
                    item = self._lines.get_nowait()
                except queue.Empty:
                    break
            self._write_out(text)

    def _write_out(self, text: list[str]) -> None:
        if not text:
            return
        try:
            self.stream.write("".join(text))
            super().flush()
        except Exception:  # a closed or broken stream: the lines are lost, the worker is not
            pass


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
