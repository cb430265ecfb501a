"""Shared by tests/integration/test_events.py and tests/integration/test_ui_browser.py: a leaking flow on real
Dask processes (scripted probe, so it runs on CPU) and polling reads of the event API."""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, task
from prefect.context import FlowRunContext

from prefect_gpu_dask import GPUDaskTaskRunner
from tests.scripted_probe import FAKE_PROBE, leak

MiB = 2**20
LEAK_BYTES = 512 * MiB


def start_guarded_cluster(procs) -> str:
    """A scheduler, a ``GPU=1`` worker and a CPU worker (the runner's guard reads the fake probe)."""
    procs.start_scheduler()
    procs.start_worker("gpu-worker", "--nthreads", "2", "--resources", "GPU=1")
    procs.start_worker("cpu-worker", "--nthreads", "2")
    procs.wait_for_workers(2)
    return procs.address


@task(tags=["gpu"], task_run_name="leaky-{nbytes}")
def leaky(nbytes: int) -> int:
    leak(nbytes)
    return nbytes


@task(tags=["gpu"], task_run_name="clean-{i}")
def clean(i: int) -> int:
    return i


def run_leaking_flow(
    address: str, clean_first: int = 0, timeout: float = 60, hold_s: float = 0
) -> dict[str, Any]:
    """``clean_first`` clean gpu tasks, one leaking one, then clean ones until the leaking
    worker has been restarted; with ``hold_s``, the flow then prints ``HOLDING <flow run id>``
    and stays running that long (for a test that kills it)."""

    @flow(name="gpu-leak-demo", task_runner=GPUDaskTaskRunner(address=address, memory_probe=FAKE_PROBE))
    def gpu_leak_demo() -> dict[str, Any]:
        for i in range(clean_first):
            clean.submit(i).result()
        leaked = leaky.submit(LEAK_BYTES)
        leaked.wait()
        runner = FlowRunContext.get().task_runner
        deadline = time.monotonic() + timeout
        i = clean_first
        while True:  # at least one clean task after the leak, then until the restart
            clean.submit(i).result()
            i += 1
            if runner.restarts or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if hold_s:
            print("HOLDING", FlowRunContext.get().flow_run.id, flush=True)
            time.sleep(hold_s)
        return {
            "flow_run_id": str(FlowRunContext.get().flow_run.id),
            "leaky_task_run_id": str(leaked.task_run_id),
            "restarts": list(runner.restarts),
        }

    return gpu_leak_demo()


def read_events(
    names: list[str],
    *,
    prefix: list[str] | None = None,
    related: str | None = None,
    resource: str | None = None,
    until: Any = None,
    timeout: float = 60,
) -> list[Any]:
    """Events from the API, polled until ``until(events)`` holds (events arrive in batches)."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import (
        EventFilter,
        EventNameFilter,
        EventRelatedFilter,
        EventResourceFilter,
    )

    event_filter = EventFilter(
        event=EventNameFilter(name=names or None, prefix=prefix),
        related=EventRelatedFilter(id=[related]) if related else None,
        resource=EventResourceFilter(id=[resource]) if resource else None,
    )
    until = until or bool
    deadline = time.monotonic() + timeout
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_events(event_filter, limit=50)
            events = list(page.events)
            while page.next_page:
                page = client.read_events_page(page.next_page)
                events += page.events
            if until(events) or time.monotonic() > deadline:
                return events
            time.sleep(0.5)


class HeadlessChromium:
    """Headless Chromium driven over the DevTools protocol (``websockets`` comes with Prefect).

    No WebDriver needed: the Prefect UI is a single-page app, so the test waits for
    rendered text with ``wait_for_text`` instead of reading the initial HTML.
    """

    def __init__(self, binary: str, profile_dir: str, width: int = 1440, height: int = 1000):
        import json
        import subprocess
        from pathlib import Path

        import httpx
        from websockets.sync.client import connect

        self._json = json
        profile = Path(profile_dir)
        profile.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                binary,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-quic",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-extensions",
                "--hide-scrollbars",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(profile / "chromium.log", "w"),
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"Chromium did not start: {(profile / 'chromium.log').read_text()}")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(t for t in targets if t["type"] == "page")
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
        self._id = 0
        self.resize(width, height)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send(self._json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            message = self._json.loads(self.ws.recv(timeout=60))
            if message.get("id") == self._id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def text(self) -> str:
        return self.evaluate("document.body ? document.body.innerText : ''") or ""

    def wait_for_text(self, *needles: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.text()
            if all(n in text for n in needles):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"{needles} not rendered within {timeout} s; page text:\n{text}")
            time.sleep(0.25)

    def click_text(self, selector: str, text: str) -> bool:
        """Click the first ``selector`` element whose trimmed text is ``text``."""
        return bool(
            self.evaluate(
                f"""(() => {{
                const el = [...document.querySelectorAll({self._json.dumps(selector)})]
                    .find(e => e.innerText.trim() === {self._json.dumps(text)});
                if (el) {{ el.click(); return true; }}
                return false;
            }})()"""
            )
        )

    def resize(self, width: int, height: int) -> None:
        self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width,
            height=height,
            deviceScaleFactor=1,
            mobile=False,
        )

    def screenshot(self, path: str) -> None:
        import base64

        data = self.call("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as fh:
            fh.write(base64.b64decode(data))

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
