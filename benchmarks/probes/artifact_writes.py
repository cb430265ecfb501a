"""What one one-row table artifact costs on the embedded server (the README's default),
written three ways from a flow: through a client of its own each (as the runner's
publisher writes them), through one client, and eight at once through one async client.
Milliseconds per artifact.

    python benchmarks/probes/artifact_writes.py [artifacts]
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from benchmarks.common import use_readme_default  # noqa: E402

use_readme_default("artifact-writes")

import asyncio  # noqa: E402
import time  # noqa: E402

from prefect import flow  # noqa: E402
from prefect.artifacts import TableArtifact  # noqa: E402
from prefect.client.orchestration import get_client  # noqa: E402

COUNT = int(sys.argv[1]) if len(sys.argv) > 1 else 150
ROW = [{"task": "noop-1", "before_bytes": 1, "after_bytes": 2, "verdict": "clean"}]


@flow
def writes() -> dict[str, float]:
    from prefect.runtime import flow_run

    def artifact() -> TableArtifact:
        return TableArtifact(table=ROW, description="probe", flow_run_id=flow_run.id)

    out = {}
    start = time.perf_counter()
    for _ in range(COUNT):
        artifact().create(_sync=True)
    out["a client each"] = (time.perf_counter() - start) / COUNT * 1e3
    start = time.perf_counter()
    with get_client(sync_client=True) as client:
        for _ in range(COUNT):
            artifact().create(client=client, _sync=True)
    out["one client"] = (time.perf_counter() - start) / COUNT * 1e3

    async def eight_at_once() -> None:
        async with get_client() as client:
            slots = asyncio.Semaphore(8)

            async def one() -> None:
                async with slots:
                    await artifact().acreate(client=client)

            await asyncio.gather(*(one() for _ in range(COUNT)))

    start = time.perf_counter()
    asyncio.run(eight_at_once())
    out["eight at once, one async client"] = (time.perf_counter() - start) / COUNT * 1e3
    return out


if __name__ == "__main__":
    for way, ms in writes().items():
        print(f"{COUNT} artifacts, {way}: {ms:.1f} ms each")
