"""The tests' own Prefect server: started again elsewhere when its port was taken."""

from __future__ import annotations

import socket
import threading
import urllib.request

from benchmarks import servers as processes
from tests import servers


def test_a_server_whose_port_was_taken_starts_again_on_another(monkeypatch):
    taken = socket.create_server(("127.0.0.1", 0))
    taken_port = taken.getsockname()[1]

    def answer_like_a_dask_comm() -> None:  # what took the port speaks no HTTP
        while True:
            try:
                conn, _ = taken.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"\x82\xabcompression\xc0\xa6python\xa7pickle-protocol\n")

    threading.Thread(target=answer_like_a_dask_comm, daemon=True).start()
    picks = iter([taken_port])
    free_port = processes.free_port
    monkeypatch.setattr(processes, "free_port", lambda: next(picks, None) or free_port())
    try:
        with servers.prefect_server() as api:
            assert f":{taken_port}/" not in api
            with urllib.request.urlopen(f"{api}/health", timeout=10) as answer:
                assert answer.status == 200
    finally:
        taken.close()
