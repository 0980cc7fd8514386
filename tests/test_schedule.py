"""The order `make test` sends the files to its workers in (``tests/conftest.py``):
the longest files first, each file's tests together and in their order."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from .conftest import LONGEST_FIRST, _longest_first

REPO = Path(__file__).resolve().parents[1]


def test_every_file_named_longest_first_exists():
    missing = [name for name in LONGEST_FIRST if not (REPO / name).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names no such file: {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_the_longest_files_go_first_and_each_file_stays_whole():
    first, second = LONGEST_FIRST[:2]
    ids = ["tests/a.py::x", "tests/a.py::y", f"{second}::p", "tests/b.py::z",
           f"{first}::q", f"{first}::r[1]", f"{second}::s", "tests/a.py::w"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    _longest_first(items)
    assert [i.nodeid for i in items] == [
        f"{first}::q", f"{first}::r[1]", f"{second}::p", f"{second}::s",
        "tests/a.py::x", "tests/a.py::y", "tests/a.py::w", "tests/b.py::z"]
