"""The import floor of capture/ and func.py (DESIGN.md §2: capture/ knows only "a function of
(params, state, x) returning a tuple of tensors"): read from the source with ``ast``, so a stray
``from yolo_func.nn import ...`` fails here, not in a review."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import yolo_func

ROOT = Path(yolo_func.__file__).parent


def _yolo_imports(path: Path) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            mods |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
            mods |= {f"{node.module}.{a.name}" for a in node.names if node.module == "yolo_func"}
    return {m for m in mods if m == "yolo_func" or m.startswith("yolo_func.")}


@pytest.mark.parametrize("path", sorted((ROOT / "capture").glob("*.py")), ids=lambda p: p.name)
def test_capture_imports_only_tree_func_and_itself(path):
    allowed = {"yolo_func", "yolo_func.tree", "yolo_func.func"}
    bad = {m for m in _yolo_imports(path) if m not in allowed and not m.startswith("yolo_func.capture")}
    assert not bad, f"[yolo_func] {path.name} imports {sorted(bad)}; capture/ may import yolo_func.tree and yolo_func.func only"


def test_func_imports_only_tree():
    assert _yolo_imports(ROOT / "func.py") == {"yolo_func", "yolo_func.tree"}
