"""docs/training.md's generated tables match the code (regenerate: python -m yolo_func.configs.docs)."""

from __future__ import annotations

import re

import pytest

from yolo_func.configs import RECIPES, Config, config_keys
from yolo_func.configs.docs import DOC, main, render


@pytest.fixture(scope="module")
def doc() -> str:
    if not DOC.is_file():
        pytest.skip(f"{DOC} not found (an installed package without the repository's docs)")
    return DOC.read_text()


def test_generated_blocks_are_current(doc):
    assert render(doc) == doc, "docs/training.md is stale: run python -m yolo_func.configs.docs"
    assert main(["--check"]) == 0


def test_options_table_lists_every_key_once_with_the_config_default(doc):
    block = doc.split("<!-- generated:options -->")[1].split("<!-- /generated:options -->")[0]
    rows = re.findall(r"^\| `([\w.]+)` \| [^|]*(?:\\\|[^|]*)* \| `([^`]*)` \|", block, flags=re.M)
    assert [k for k, _ in rows] == config_keys()
    cfg = Config()
    for key, default in rows:
        value = cfg
        for part in key.split("."):
            value = getattr(value, part)
        assert default == repr(value), key


def test_recipes_table_lists_every_recipe(doc):
    block = doc.split("<!-- generated:recipes -->")[1].split("<!-- /generated:recipes -->")[0]
    assert re.findall(r"^\| `(\w[\w-]*)` \|", block, flags=re.M) == list(RECIPES)


def test_render_names_missing_markers():
    with pytest.raises(ValueError, match=r"has no '<!-- generated:recipes -->' \.\.\. '<!-- /generated:recipes -->' block"):
        render("# nothing here\n")
