"""The API reference is generated from the docstrings and stays complete and true.

* ``docs/api.md`` equals what ``tools/gen_api_docs.py`` generates now (``--check``).
* No public function or class gains a docstring gap (text, shapes/dtypes, a ``>>>`` example):
  the gaps are a subset of ``tools/api_gaps.txt``, the list of those left when the check was
  introduced. The list may only shrink: fill a docstring, then delete its line.
* Every ``>>>`` example in ``yolo_func`` runs (``doctest``, on the CPU).
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import gen_api_docs  # noqa: E402

BASELINE = ROOT / "tools" / "api_gaps.txt"


def test_api_md_is_up_to_date(capsys):
    status = gen_api_docs.main(["--check"])  # in-process: the same code path as the command line
    assert status == 0, capsys.readouterr().err + "\nrun: python tools/gen_api_docs.py"


def test_no_new_docstring_gaps():
    known = {line.split(":")[0] for line in BASELINE.read_text().splitlines() if line.strip() and not line.startswith("#")}
    new = [g for g in gen_api_docs.gaps() if g.split(":")[0] not in known]
    assert not new, ("public symbols whose docstring lacks a text, shapes/dtypes or a >>> example "
                     "(python tools/gen_api_docs.py --gaps):\n" + "\n".join(new))


def test_gap_check_can_fail():
    """The gap finder flags what it should: a missing docstring, a tensor function without shapes,
    a missing example; and passes a complete docstring."""
    import types

    mod = types.ModuleType("fake")

    def bare(x):
        return x

    def no_shapes(x: "torch.Tensor"):
        """Doubles x.

        >>> 1
        1
        """

    def complete(x: "torch.Tensor"):
        """Doubles ``x: float[B, 4]``.

        >>> 2
        2
        """

    def no_example(x):
        """Nothing to do with tensors."""

    found = {}
    for f in (bare, no_shapes, complete, no_example):
        e = gen_api_docs.Entry("fake", f.__name__, f)
        doc = gen_api_docs._doc(f)
        found[f.__name__] = (bool(doc), gen_api_docs._takes_tensors(f) and not gen_api_docs.SHAPE_RE.search(doc or ""),
                             ">>>" in (doc or ""))
        del e
    assert found["bare"][0] is False
    assert found["no_shapes"][1] is True and found["complete"][1] is False
    assert found["no_example"][2] is False and found["complete"][2] is True


def _modules() -> list[str]:
    import yolo_func

    return ["yolo_func"] + sorted(m.name for m in pkgutil.walk_packages(yolo_func.__path__, "yolo_func."))


@pytest.fixture
def one_thread():
    """Tiny examples run faster on one intra-op thread (on a shared 2-core machine, 5x less CPU)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_docstring_examples_run(one_thread):
    failures, attempted = [], 0
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    for name in _modules():
        mod = importlib.import_module(name)
        finder = doctest.DocTestFinder(exclude_empty=True)
        runner = doctest.DocTestRunner(optionflags=flags)
        for test in finder.find(mod, name):
            result = runner.run(test, out=lambda s, f=failures: f.append(s))
            attempted += result.attempted
    assert attempted > 100, f"only {attempted} examples found"
    assert not failures, "".join(failures)
