"""The package's import graph: which process each module runs in, read from its folder.

``prefect_gpu_dask/flow/`` runs in the flow process, ``scheduler/`` on the Dask
scheduler, ``worker/`` in a Dask worker (and its nanny), ``cli/`` in the operator's
terminal (the ``prefect-gpu-dask`` command, and the host cluster it runs); the modules
at the top are what more than one of them needs. The rules, over every import in the package (those
inside functions too; ``if TYPE_CHECKING:`` blocks, which never run, aside):

1. There are no cycles.
2. Nothing climbs back up: a package's ``__init__`` imports nothing of the package at
   run time, and no module imports the package's public names from the top (the
   public ``prefect_gpu_dask`` map imports down into every folder).
3. A module imports from its own folder and from the top only. A top-level module
   imports nothing from ``flow/``, ``scheduler/`` or ``worker/``.
4. ``cli/`` is a client of the cluster as the flow is, and starts a cluster as the
   runner does: it may import ``flow/``. ``__main__`` (``python -m prefect_gpu_dask``)
   imports the command from ``cli/``.
5. The one exception is what a process ships to another one to run there: a plugin it
   registers, a function for ``client.run`` / ``run_on_scheduler``, a wrapper that
   travels inside a task, the task function itself. Each such import is listed in
   ``SHIPPED`` by importing module, source module and name. Nothing is shipped to the
   flow, and the scheduler ships nothing, so ``worker/`` and ``scheduler/`` never import
   ``flow/`` and ``scheduler/`` never imports ``worker/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import prefect_gpu_dask

ROOT = Path(prefect_gpu_dask.__file__).parent
PACKAGE = "prefect_gpu_dask"
PROCESSES = ("flow", "scheduler", "worker", "cli")
# importing folder (None: the top) -> folders it may import besides its own and the top
CLIENTS = {"cli": {"flow"}}
ENTRY = {"__main__": {"cli"}}

# importing module -> {source module: names it ships to the source's process}
SHIPPED: dict[str, dict[str, set[str]]] = {
    "flow.runner": {
        "scheduler.metrics": {"GPUMetrics"},  # the metrics plugin, registered on the scheduler
        "scheduler.shared": {"SharedBlobs"},  # the shared blobs' keeper, likewise
        "worker.guard": {"GPUMemoryGuard"},  # the guard plugin, registered for every worker
        "worker.labels": {"GPULabels"},  # the labels plugin, likewise
        "worker.stream": {"PromptStream"},  # the prompt stream plugin, likewise
    },
    "flow.submission": {
        # the Dask task of every task run, and what prepares a worker for a flow run
        "worker.entry": {"run_prefect_task", "prepare_for_flow_run"},
        "scheduler.shared": {"forget_namespace"},  # run on the scheduler as a flow run ends
        "worker.taskwrap": {"with_around", "stacked"},  # the clone that travels with the task
        "worker.fallback": {"falling_back"},  # wrappers inside that clone
        "worker.guard": {"guarding"},
        "worker.host_gpu_lock": {"claiming_gpu"},
        "worker.deadline": {"deadline"},
        "worker.oom_retry": {"oom_retry_condition", "placing"},
    },
    "flow.prefect_api": {
        "worker.entry": {"end_flow_run_events"},  # run on every worker as a flow run ends
    },
    "flow.recycling": {
        "scheduler.metrics": {"count_restart"},  # through run_on_scheduler
        "scheduler.recycling": {  # through run_on_scheduler, and the lost-worker plugin
            "InterruptedTasks",
            "blockers",
            "hand_back_queued",
            "keys_on",
            "lost",
            "mark_interrupted",
            "other_clients",
            "restart_if_safe",
            "restore_no_workers_timeout",
            "suspend_no_workers_timeout",
        },
        "worker.recycling": {"drain", "resume"},  # through client.run
        "worker.guard": {"replacement_state"},  # through client.run
    },
    "flow.resource_wait": {"scheduler.fallback": {"release", "stranded", "fail"}},  # run_on_scheduler
    "worker.quarantine": {"scheduler.quarantine": {"withdraw"}},  # run on the scheduler by the worker
    "cli.host_cluster": {  # registered on the host cluster as it starts
        "worker.labels": {"GPULabels"},
        "scheduler.metrics": {"GPUMetrics"},
    },
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


MODULES = {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _short(module: str) -> str:
    return module[len(PACKAGE) + 1 :] if module != PACKAGE else ""


def _folder(module: str) -> str | None:
    """``flow``, ``scheduler``, ``worker`` or ``cli``; None for the top (shared) modules."""
    first = _short(module).split(".")[0]
    return first if first in PROCESSES else None


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(module: str) -> list[tuple[str, str | None]]:
    """(imported package module, name or None) for every import that runs."""
    tree = ast.parse(MODULES[module].read_text())
    found: list[tuple[str, str | None]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, None) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                anchor = module if _is_package(module) else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((submodule, None) if submodule in MODULES else (base, alias.name))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [(target, name) for target, name in found if target in MODULES]


GRAPH = {module: _imports(module) for module in MODULES}


def test_the_package_has_the_three_process_folders_and_a_shared_top():
    assert {_folder(m) for m in MODULES} == {None, *PROCESSES}
    assert all(_folder(m) is None or len(_short(m).split(".")) <= 2 for m in MODULES), "one level of folders"


def test_no_cycles():
    edges = {m: {target for target, _ in imports} for m, imports in GRAPH.items()}
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module) :] + [module]
            pytest.fail("import cycle: " + " -> ".join(map(_short, cycle)))
        if module in done:
            return
        for target in sorted(edges[module]):
            walk(target, [*path, module])
        done.add(module)

    for module in sorted(edges):
        walk(module, [])


def test_nothing_climbs_back_up():
    for module, imports in GRAPH.items():
        if _is_package(module):
            assert not imports, f"{module}'s __init__ imports {imports}"
        public = [name for target, name in imports if target == PACKAGE]
        assert not public, f"{module} imports {public} from the package's public map"


def test_each_module_imports_its_own_folder_and_the_top_and_what_it_ships():
    unlisted = []
    for module, imports in GRAPH.items():
        here = _folder(module)
        for target, name in imports:
            there = _folder(target)
            if there is None or there == here or target == PACKAGE:
                continue
            if there in CLIENTS.get(here, set()) | ENTRY.get(_short(module), set()):
                continue
            shipped = SHIPPED.get(_short(module), {}).get(_short(target), set())
            if here is None or name not in shipped:
                unlisted.append(f"{_short(module)} imports {_short(target)}.{name or '*'}")
    assert not unlisted, "\n".join(unlisted)


def test_the_shipped_list_is_what_the_code_imports():
    """No stale allowance: every listed name is imported, and none of it goes to the flow."""
    for importer, sources in SHIPPED.items():
        imported = {(_short(t), n) for t, n in GRAPH[f"{PACKAGE}.{importer}"]}
        for source, names in sources.items():
            assert _folder(f"{PACKAGE}.{source}") != "flow"
            assert not (_folder(f"{PACKAGE}.{importer}") == "scheduler"), importer
            for name in names:
                assert (source, name) in imported, f"{importer} no longer imports {source}.{name}"


def test_the_architecture_doc_lists_every_module_in_its_folder():
    """docs/architecture.md's listing is this package: one line per module, in its folder."""
    section = (ROOT.parent / "docs" / "architecture.md").read_text()
    block = section[section.index("```") + 3 :]
    block = block[: block.index("```")]
    listed, folder = set(), None
    for line in block.splitlines():
        name = line.strip().split(" ")[0] if line.strip() else ""
        if name.endswith("/") and name != f"{PACKAGE}/":
            folder = name.rstrip("/")
        elif name.endswith(".py"):
            indent = len(line) - len(line.lstrip())
            parts = (folder, name[:-3]) if indent > 2 else (name[:-3],)
            listed.add(".".join((PACKAGE, *parts)).removesuffix(".__init__"))
    packages = {m for m in MODULES if _is_package(m) and m != PACKAGE}  # the folders' __init__
    assert listed == set(MODULES) - packages
