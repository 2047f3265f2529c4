"""The suite's own scheduling (tests/conftest.py): files by the seconds of their slow tests, longest first."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import pytest_collection_modifyitems


def _item(path: str, name: str, seconds=None):
    marker = None if seconds is None else pytest.mark.slow(*([] if seconds is ... else [seconds])).mark
    return SimpleNamespace(path=Path(path), name=name, get_closest_marker=lambda _name: marker)


def test_files_run_longest_first_and_keep_their_own_order():
    items = [_item("a.py", "a1"), _item("a.py", "a2", 5), _item("b.py", "b1", 30), _item("c.py", "c1"),
             _item("d.py", "d1", 10), _item("d.py", "d2", 10), _item("e.py", "e1", ...)]
    pytest_collection_modifyitems(None, items)
    # b 30 s, d 20 s, a 5 s, e 1 (slow without seconds), then c (no slow test) in collection order
    assert [item.name for item in items] == ["b1", "d1", "d2", "a1", "a2", "e1", "c1"]


def test_setup_cfg_keeps_xdist_from_reordering_the_files():
    import configparser

    config = configparser.ConfigParser()
    config.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    assert "--no-loadscope-reorder" in config["tool:pytest"]["addopts"].split()
