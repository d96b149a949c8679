"""``yolo_func.io.ultralytics`` is the one public face of the reference-weight modules: every public
name is re-exported, and nothing outside ``yolo_func/io`` imports the internal ``_ref_*`` /
``_safe_pickle`` modules (issue 11, item 5)."""

from __future__ import annotations

import ast
from pathlib import Path

import yolo_func.io as io_pkg
import yolo_func.io.ultralytics as facade

ROOT = Path(__file__).resolve().parents[2]
INTERNAL = ("_ref_keys", "_ref_convert", "_ref_infer", "_ref_file", "_safe_pickle")


def test_facade_reexports_every_public_name_of_the_internal_modules():
    import importlib

    for name in INTERNAL:
        mod = importlib.import_module(f"yolo_func.io.{name}")
        for public in mod.__all__:
            assert public in facade.__all__, f"yolo_func.io.{name}.{public} is not re-exported by the facade"
            assert getattr(facade, public) is getattr(mod, public)
    for public in facade.__all__:
        if public in io_pkg.__all__:
            assert getattr(io_pkg, public) is getattr(facade, public)
    # what users import from yolo_func.io (the package level) today and after this change
    assert {"from_reference", "to_reference", "load_reference_checkpoint", "load_reference_weights",
            "load_reference_model", "read_reference_checkpoint", "infer_reference_model"} <= set(io_pkg.__all__)


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
    return out


def test_nothing_outside_io_imports_the_internals():
    offenders = []
    for folder in ("yolo_func", "tests", "benchmarks", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.parent == ROOT / "yolo_func" / "io":
                continue
            for line, module in _imports(path):
                if any(module == f"yolo_func.io.{m}" or module.startswith(f"yolo_func.io.{m}.") for m in INTERNAL):
                    offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert offenders == [], "import these through yolo_func.io.ultralytics (or yolo_func.io):\n" + "\n".join(offenders)
