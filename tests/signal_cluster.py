"""A cluster class whose module sets a signal handler at import, as dask-jobqueue's
does: importing it anywhere but a process's main thread raises ``ValueError``."""

from __future__ import annotations

import signal

from distributed import LocalCluster

signal.signal(signal.SIGUSR2, signal.getsignal(signal.SIGUSR2))


class SignalCluster(LocalCluster):
    pass
