"""Reading alembic's migration graph from its scripts, and a database's migration
against it (``flow/embedded_database.py``), on files written here."""

from __future__ import annotations

import contextlib
import sqlite3
import textwrap
from pathlib import Path

import pytest

from prefect_gpu_dask.flow import embedded_database


def script(folder: Path, name: str, header: str) -> None:
    body = '"""A migration."""\nimport sqlalchemy as sa\n\n' + textwrap.dedent(header)
    (folder / f"{name}.py").write_text(body + "\n\ndef upgrade():\n    pass\n")


def test_the_graph_is_read_from_plain_typed_and_merging_scripts(tmp_path):
    script(tmp_path, "a", 'revision = "a1"\ndown_revision = None\n')
    script(tmp_path, "b", 'revision: str = "b2"\ndown_revision: Union[str, None] = "a1"\n')
    script(tmp_path, "c", "revision = 'c3'\ndown_revision = 'a1'\n")
    merge = 'revision = "d4"\ndown_revision = (\n    "b2",\n    "c3",\n)\nbranch_labels = None\n'
    script(tmp_path, "d", merge)
    assert embedded_database.migration_graph(tmp_path) == ({"a1", "b2", "c3", "d4"}, {"d4"})

    script(tmp_path, "e", 'revision = "e5"\ndown_revision = ["d4"]\n')
    script(tmp_path, "f", 'revision = "f6"\ndown_revision = ("d4",)\n')
    assert embedded_database.migration_graph(tmp_path)[1] == {"e5", "f6"}  # two heads, as alembic says


def test_a_script_the_reader_does_not_understand_is_an_error_not_a_guess(tmp_path):
    script(tmp_path, "a", 'revision = "a1"\ndown_revision = None\n')
    script(tmp_path, "b", "REVISION = compute()\n")
    with pytest.raises(LookupError, match="0 revision lines"):
        embedded_database.migration_graph(tmp_path)


def database_at(path: Path, revision: str | None) -> Path:
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL)")
        if revision is not None:
            db.execute("INSERT INTO alembic_version VALUES (?)", (revision,))
    return path


def test_a_database_is_behind_only_at_a_revision_this_prefect_has(tmp_path, monkeypatch):
    monkeypatch.setattr(embedded_database, "migrations", lambda: (frozenset({"a1", "b2"}), frozenset({"b2"})))
    assert embedded_database.migration_state(tmp_path / "none-yet.db") == "behind"
    assert embedded_database.migration_state(database_at(tmp_path / "empty.db", None)) == "behind"
    assert embedded_database.migration_state(database_at(tmp_path / "older.db", "a1")) == "behind"
    assert embedded_database.migration_state(database_at(tmp_path / "latest.db", "b2")) == "latest"
    # A newer Prefect's database: this one cannot migrate it, so nothing is locked for it.
    assert embedded_database.migration_state(database_at(tmp_path / "newer.db", "z9")) == "unknown"
    (tmp_path / "torn.db").write_bytes(b"not a database")
    assert embedded_database.migration_state(tmp_path / "torn.db") == "behind"  # unreadable: take the lock


def test_unreadable_migrations_leave_the_servers_to_prefect(tmp_path, monkeypatch):
    def unreadable():
        raise LookupError("moved")

    monkeypatch.setattr(embedded_database, "migrations", unreadable)
    assert embedded_database.migration_state(tmp_path / "none-yet.db") == "unknown"
