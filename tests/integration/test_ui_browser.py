"""The GPU memory report as a person sees it: the Prefect UI in headless Chromium.

A dedicated ``prefect server start`` (UI included, its own PREFECT_HOME) runs on
127.0.0.1; a flow whose gpu task leaks runs against it in a subprocess, on real Dask
processes with the scripted probe (so this works on CPU-only machines); Chromium then
opens the flow run's page, goes to its Artifacts tab and into the ``gpu-memory`` table,
and the test reads the rendered table.

Chromium: ``$CHROMIUM`` or ``chromium`` on PATH. Where it is missing the test installs
Debian's ``chromium`` with apt-get when it runs as root (opt out with
``PREFECT_GPU_DASK_INSTALL_CHROMIUM=0``), and otherwise skips, saying why.

Screenshots go to the test's tmp dir, and to ``docs/`` when the file there is missing
or ``PREFECT_GPU_DASK_UPDATE_SCREENSHOTS=1`` (so ordinary runs leave the tree clean).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from prefect_gpu_dask.flow.chart import WIDTH
from prefect_gpu_dask.flow.reporting import SUMMARY_KEY, TABLE_KEY
from tests.servers import migrated_sqlite
from tests.ui_helpers import LEAK_BYTES, HeadlessChromium, start_guarded_cluster

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
TABLE_PNG = "flow-run-gpu-memory.png"
SUMMARY_PNG = "flow-run-gpu-memory-summary.png"
CHART_PNG = "flow-run-gpu-memory-chart.png"
# The summary's chart as the browser decoded it, scrolled into view.
CHART_IMAGE = """(() => {
    const img = [...document.images].find(i => i.src.startsWith('data:image/svg+xml'));
    if (!img) return null;
    img.scrollIntoView({block: 'center'});
    return {complete: img.complete, width: img.naturalWidth, shown: img.getBoundingClientRect().height};
})()"""
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

FLOW_SCRIPT = """
import json, sys
from tests.ui_helpers import run_leaking_flow
out = run_leaking_flow(sys.argv[1], clean_first=3)
print("RESULT " + json.dumps({k: v for k, v in out.items() if k != "restarts"}
                             | {"restarts": len(out["restarts"])}))
"""


def find_chromium() -> str | None:
    if os.environ.get("CHROMIUM"):
        return shutil.which(os.environ["CHROMIUM"])
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


def install_chromium() -> str:
    """Try Debian's chromium; returns why it is still missing (if it is)."""
    if os.environ.get("PREFECT_GPU_DASK_INSTALL_CHROMIUM", "1") == "0":
        return "PREFECT_GPU_DASK_INSTALL_CHROMIUM=0 forbids installing it"
    if not shutil.which("apt-get"):
        return "no apt-get here to install Debian's chromium"
    if os.geteuid() != 0:
        return "not root, so `apt-get install chromium` is not possible"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "chromium"]
    output = ""
    for command in (install, ["apt-get", "update"], install):
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
        except subprocess.TimeoutExpired:
            return f"`{' '.join(command)}` timed out"
        output = done.stdout + done.stderr
        if command is install and done.returncode == 0:
            return ""
    return "`apt-get install chromium` failed: " + output.strip()[-500:]


@pytest.fixture(scope="module")
def chromium_path() -> str:
    path = find_chromium()
    if path is None:
        why = install_chromium()
        path = find_chromium()
        if path is None:
            pytest.skip(
                f"headless Chromium not found ($CHROMIUM, or {'/'.join(BROWSERS)} on PATH) "
                f"and not installable: {why}"
            )
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**updates: str) -> dict[str, str]:
    """This process's environment without PREFECT_* settings (the harness's included)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return {**env, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **updates}


class PrefectServer:
    """``prefect server start`` on 127.0.0.1 with its own PREFECT_HOME (SQLite, UI on)."""

    def __init__(self, home: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_url = f"{self.url}/api"
        home.mkdir(parents=True)
        migrated_sqlite(home / "prefect.db")  # PREFECT_HOME's default database
        self.log = home / "server.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "prefect", "server", "start"]
            + ["--host", "127.0.0.1", "--port", str(self.port)]
            + ["--no-scheduler", "--no-late-runs", "--analytics-off"],  # not needed here
            env=clean_env(
                PREFECT_HOME=str(home),
                PREFECT_API_URL=self.api_url,
                PREFECT_UI_API_URL=self.api_url,
                PREFECT_UI_ENABLED="true",
                PREFECT_SERVER_DATABASE_MIGRATE_ON_START="false",
            ),
            stdout=open(self.log, "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped with all it starts
        )

    def wait_until_up(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prefect server start exited:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"prefect server start not up in {timeout} s:\n{self.log.read_text()}")

    def artifacts(self, flow_run_id: str) -> dict[str, dict]:
        body = {"flow_runs": {"id": {"any_": [flow_run_id]}}}
        response = httpx.post(f"{self.api_url}/artifacts/filter", json=body, timeout=10)
        response.raise_for_status()
        return {a["key"]: a for a in response.json()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def save_screenshot(browser: HeadlessChromium, tmp_path: Path, name: str) -> Path:
    shot = tmp_path / name
    browser.screenshot(str(shot))
    assert shot.stat().st_size > 10_000, "blank screenshot"
    target = DOCS / name
    if not target.exists() or os.environ.get("PREFECT_GPU_DASK_UPDATE_SCREENSHOTS") == "1":
        DOCS.mkdir(exist_ok=True)
        shutil.copyfile(shot, target)
    return shot


def table_cells(browser: HeadlessChromium) -> list[list[str]]:
    return browser.evaluate(
        "[...document.querySelectorAll('table tr')].map(tr => [...tr.cells].map(c => c.innerText.trim()))"
    )


@pytest.mark.timeout(900)  # a first run may install Chromium
def test_flow_run_page_renders_the_gpu_memory_artifact(chromium_path, dask_processes, tmp_path):
    started = time.monotonic()
    browser = None
    server = PrefectServer(tmp_path / "prefect-home")
    try:
        # The server migrates its database while the Dask processes start.
        address = start_guarded_cluster(dask_processes)
        server.wait_until_up()
        phases = {"server up": time.monotonic() - started}

        # -- a leaking flow, run the way a user runs one: its own process, API from env
        done = subprocess.run(
            [sys.executable, "-c", FLOW_SCRIPT, address],
            cwd=ROOT,
            env=clean_env(
                PREFECT_API_URL=server.api_url,
                PREFECT_HOME=str(tmp_path / "client-home"),
                PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            ),
            capture_output=True,
            text=True,
            timeout=240,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
        out = json.loads(lines[-1].removeprefix("RESULT "))
        assert out["restarts"] == 1, out
        flow_run_id = out["flow_run_id"]
        phases["flow run"] = time.monotonic() - started
        artifacts = server.artifacts(flow_run_id)
        assert {TABLE_KEY, SUMMARY_KEY} <= set(artifacts), artifacts

        try:
            browser = HeadlessChromium(chromium_path, str(tmp_path / "chromium"), width=1600, height=900)
        except RuntimeError as exc:
            pytest.skip(f"Chromium is installed but cannot start here: {exc}")

        # -- the flow run's page: its Artifacts tab lists both artifacts --------------
        browser.goto(f"{server.url}/runs/flow-run/{flow_run_id}")
        browser.wait_for_text("gpu-leak-demo", "Artifacts", f"leaky-{LEAK_BYTES}")
        assert browser.click_text("li.p-tab, [role=tab]", "Artifacts")
        browser.wait_for_text(TABLE_KEY, SUMMARY_KEY, "GPU memory per guarded task")

        # -- into the table artifact, as a user clicks its card ------------------------
        assert browser.evaluate(
            """(() => {
                const card = [...document.querySelectorAll('a[href*="/artifacts/artifact/"]')]
                    .find(a => a.innerText.split('\\n').map(s => s.trim()).includes('gpu-memory'));
                if (card) { card.click(); return true; }
                return false;
            })()"""
        ), "no gpu-memory artifact card on the flow run's Artifacts tab"
        text = browser.wait_for_text(f"leaky-{LEAK_BYTES}", "512.00 MiB", "clean-3")
        assert browser.evaluate("location.pathname") == (f"/artifacts/artifact/{artifacts[TABLE_KEY]['id']}")
        assert "GPU memory per guarded task (prefect-gpu-dask)" in text
        rows = table_cells(browser)
        header = rows[0]
        assert header[:6] == ["task_run_name", "verdict", "before", "after", "peak", "delta"]
        by_task = {row[0]: dict(zip(header, row)) for row in rows[1:]}
        leaky_row = by_task[f"leaky-{LEAK_BYTES}"]
        assert leaky_row["verdict"] == "leak"
        assert leaky_row["delta"] == leaky_row["after"] == "512.00 MiB"
        assert leaky_row["before"] == "0 B"
        assert by_task.keys() >= {"clean-0", "clean-1", "clean-2", "clean-3"}
        assert all(
            row["verdict"] == "clean" for name, row in by_task.items() if name != leaky_row["task_run_name"]
        )
        browser.resize(1600, 760)
        save_screenshot(browser, tmp_path, TABLE_PNG)

        # -- the markdown summary renders too -----------------------------------------
        browser.resize(1600, 1040)
        browser.goto(f"{server.url}/artifacts/artifact/{artifacts[SUMMARY_KEY]['id']}")
        text = browser.wait_for_text("GPU memory summary", "Worker restarts", "Top memory consumers")
        assert f"leaky-{LEAK_BYTES} left 512.00 MiB on GPU 0" in text
        save_screenshot(browser, tmp_path, SUMMARY_PNG)

        # -- its right-sizing hints, and memory over time drawn as an image -----------
        text = browser.wait_for_text("Right-sizing", "GPU memory over time")
        assert "leaky peaks at 512.00 MiB of 16.00 GiB: gpu:0.05 fits; it asked for gpu" in text, text
        drawn = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (drawn and drawn["width"] > 0):
            drawn = browser.evaluate(CHART_IMAGE)
            time.sleep(0.25)
        assert drawn and drawn["complete"] and drawn["width"] == WIDTH and drawn["shown"] > 100, drawn
        save_screenshot(browser, tmp_path, CHART_PNG)
        phases["browser"] = time.monotonic() - started
    finally:
        if browser is not None:
            browser.close()
        server.stop()
    print("UI test phases (s, cumulative):", {k: round(v, 1) for k, v in phases.items()})
