"""Import direction around structures/: it is the low floor that assign/, heads/ and losses/ share.

Read from the source with ``ast`` (every ``import`` / ``from ... import`` statement, including
ones inside functions), so a lazy import cannot slip through.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

import yolo_func.losses as losses
import yolo_func.structures as structures

PKG = Path(structures.__file__).resolve().parents[1]


def _imports(folder: str) -> dict[str, set[str]]:
    """``{file: {imported yolo_func module, ...}}`` for every .py file under ``yolo_func/<folder>``."""
    out = {}
    for path in sorted((PKG / folder).glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        out[path.name] = {n for n in names if n == "yolo_func" or n.startswith("yolo_func.")}
    assert out, f"no modules found under {PKG / folder}"
    return out


def test_structures_imports_only_itself():
    bad = {f: sorted(m for m in mods if not m.startswith("yolo_func.structures")) for f, mods in _imports("structures").items()}
    assert {f: m for f, m in bad.items() if m} == {}


def test_assign_does_not_import_losses_heads_or_train():
    found = {f: sorted(m for m in mods if m.split(".")[1] in ("losses", "heads", "train", "capture"))
             for f, mods in _imports("assign").items()}
    assert {f: m for f, m in found.items() if m} == {}


def test_heads_import_only_their_own_losses():
    # A head's loss function is bound into its Head(init, apply, loss, decode) value: the head
    # owns it. Codecs come from structures/.
    found = {f: sorted(m for m in mods if m.startswith("yolo_func.losses") and m != "yolo_func.losses.heads")
             for f, mods in _imports("heads").items()}
    assert {f: m for f, m in found.items() if m} == {}


@pytest.mark.parametrize("name", ["dist2bbox", "bbox2dist", "bbox_iou", "ciou", "dfl_expectation"])
def test_losses_re_exports_are_the_structures_objects(name):
    obj = getattr(structures, name)
    assert getattr(losses, name) is obj
    old_home = {"dist2bbox": "box", "bbox2dist": "box", "bbox_iou": "box", "ciou": "ciou", "dfl_expectation": "dfl"}[name]
    assert getattr(importlib.import_module(f"yolo_func.losses.{old_home}"), name) is obj
    assert obj.__module__.startswith("yolo_func.structures.")
    # importing the old submodule must not rebind the package attribute (``losses.ciou`` is the function)
    assert getattr(losses, name) is obj
