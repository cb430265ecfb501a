"""1,000 trivial ``gpu``-tagged task runs against 1,000 untagged ones, through the runner,
on a Prefect server backed by SQLite and by PostgreSQL: ``run.py``'s ``tagged`` section
on its own (``benchmarks/sections/tagged.py`` says how it measures).

    python benchmarks/per_task_gpu.py                # 1,000 tasks, 3 rounds each
    python benchmarks/per_task_gpu.py --tasks 200 --rounds 2

Both servers are ``prefect server start`` on 127.0.0.1, one on SQLite in a temp dir and
one on Debian's PostgreSQL, started here on 127.0.0.1 (``benchmarks/servers.py``).
Prints a table and writes ``benchmarks/results/<date>-<device>-per-task-gpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import date
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks.* when run as a script
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.tasks < 1 or args.rounds < 1:
        parser.error(f"--tasks {args.tasks} and --rounds {args.rounds} must be >= 1")

    from benchmarks.common import device_name, versions
    from benchmarks.sections.tagged import compare, print_table

    result: dict[str, Any] = {
        "date": date.today().isoformat(),
        "device": device_name(),
        "versions": versions(),
    } | compare(args.tasks, args.rounds)
    result["per_task_gpu_1000"] = result.pop("summary")
    print_table(result)
    slug = result["device"].replace(" ", "-").replace("(", "").replace(")", "").lower()
    out = ROOT / "benchmarks" / "results" / f"{result['date']}-{slug}-per-task-gpu.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
