"""The options and recipes tables of ``docs/training.md``, generated from the dataclasses so the
documentation never drifts from the code (a test compares them).

    python -m yolo_func.configs.docs            # rewrite the generated blocks of docs/training.md
    python -m yolo_func.configs.docs --check    # exit 1 when they are stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from yolo_func.configs.base import FieldInfo, field_info, type_name
from yolo_func.configs.registry import FLAGS, RECIPES, get_recipe

__all__ = ["options_table", "recipes_table", "flags_table", "render", "BLOCKS", "DOC"]

#: The documentation file holding the generated blocks.
DOC = Path(__file__).resolve().parents[2] / "docs" / "training.md"


def _fmt(value: Any) -> str:
    if isinstance(value, str):
        return f"`{value!r}`"
    return f"`{value!r}`" if value is not None else "`None`"


def _bounds(info: FieldInfo) -> str:
    m = info.meta
    parts = [f"{op} {m[k]:g}" for k, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")) if m.get(k) is not None]
    if m.get("multiple_of"):
        parts.append(f"multiple of {m['multiple_of']}")
    if m.get("pattern") is not None:
        parts.append(f"matches `{m['pattern'].pattern}`")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def options_table() -> str:
    """A markdown table of every option: key, type, default, bounds, meaning."""
    lines = ["| key | type | default | bounds | meaning |", "| --- | --- | --- | --- | --- |"]
    for info in field_info():
        lines.append(f"| `{info.key}` | {_cell(type_name(info.type))} | {_cell(_fmt(info.default))} | {_cell(_bounds(info))} | {_cell(info.help)} |")
    return "\n".join(lines)


def recipes_table() -> str:
    """A markdown table of every recipe: name, module, model, data, size, batch, epochs, device, replay."""
    lines = ["| `--model` | module | scale, task | data | imgsz | batch | epochs | device | capture |",
             "| --- | --- | --- | --- | --: | --: | --: | --- | --- |"]
    for name, module in RECIPES.items():
        c = get_recipe(name)
        lines.append(f"| `{name}` | `{module.rsplit('.', 1)[-1]}.py` | {c.model.scale}, {c.model.task} | `{c.data.path}` | "
                     f"{c.data.image_size} | {c.data.batch_size} | {c.train.epochs} | {c.train.device} | {c.train.capture} |")
    return "\n".join(lines)


def flags_table() -> str:
    """A markdown table of the everyday command-line flags and the keys they set."""
    lines = ["| flag | sets |", "| --- | --- |", "| `--model NAME` | the recipe (table above) |"]
    lines += [f"| `--{flag}` | `{key}` |" for flag, key in FLAGS.items()]
    return "\n".join(lines)


#: Block name -> generator; a block sits between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->``.
BLOCKS = {"recipes": recipes_table, "flags": flags_table, "options": options_table}


def render(text: str) -> str:
    """``text`` with every generated block replaced by its current table.

    Raises:
      ValueError: a block's markers are missing.
    """
    for name, make in BLOCKS.items():
        begin, end = f"<!-- generated:{name} -->", f"<!-- /generated:{name} -->"
        i, j = text.find(begin), text.find(end)
        if i < 0 or j < i:
            raise ValueError(f"[yolo_func] {DOC.name} has no '{begin}' ... '{end}' block; add the two markers where the table goes")
        text = text[: i + len(begin)] + "\n" + make() + "\n" + text[j:]
    return text


def main(argv: list[str] | None = None) -> int:
    """Rewrite (or ``--check``) the generated blocks of ``docs/training.md``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale, without writing")
    parser.add_argument("--path", type=Path, default=DOC)
    args = parser.parse_args(argv)
    text = args.path.read_text()
    new = render(text)
    if new == text:
        return 0
    if args.check:
        print(f"{args.path} is stale: run python -m yolo_func.configs.docs", file=sys.stderr)
        return 1
    args.path.write_text(new)
    print(f"updated {args.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
