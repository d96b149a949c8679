"""Every code example in ``docs/*.md`` and ``README.md`` stays true.

* Each ```python block runs on the CPU in a temporary folder, the blocks of one page in order and in
  one namespace (a page reads as one session), unless its first line is ``# GPU only`` (those run
  in the GPU checklist). ``README.md``'s blocks run with the image sizes of ``SHRINK`` (the same
  code at a smaller size, as ``tests/test_readme.py`` does), every other page as written.
* Each ``yolo-func ...`` command in a ```bash block is parsed by the real argument parser of
  ``yolo_func.cli.main`` (nothing runs), so a renamed or removed flag fails here.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
#: Per page, text replacements applied before running (README shows full-size calls).
SHRINK = {"README.md": [("640, 640", "64, 64"), ("(4, 320)", "(2, 64)")]}
_BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def blocks(page: Path, lang: str) -> list[tuple[int, str]]:
    """The ``lang`` fenced blocks of ``page`` as ``(line number, code)``."""
    text = page.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(2)) for m in _BLOCK.finditer(text) if m.group(1) == lang]


def cli_commands(code: str) -> list[str]:
    """``yolo-func ...`` commands of a bash block: continuation lines joined, comments dropped,
    ``&&`` / ``;`` chains split."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0].strip()
        for part in re.split(r"&&|;|\|", line):
            part = part.strip()
            if part.startswith("yolo-func"):
                out.append(part)
    return out


def _python_pages() -> list[Path]:
    return [p for p in PAGES if blocks(p, "python")]


@pytest.fixture
def one_thread():
    """The examples are tiny: one intra-op thread runs them with far less CPU on a shared machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("page", _python_pages(), ids=lambda p: p.name)
def test_python_blocks_run_on_the_cpu(page: Path, tmp_path, monkeypatch, one_thread):
    monkeypatch.chdir(tmp_path)
    # the built-in data is generated into the shared cache (as the CLI does), not into tmp_path
    ns: dict = {"__name__": f"docs_{page.stem}"}
    ran = 0
    for line, code in blocks(page, "python"):
        if code.lstrip().startswith("# GPU only"):
            continue
        for old, new in SHRINK.get(page.name, []):
            code = code.replace(old, new)
        try:
            exec(compile(code, f"{page.name}:{line}", "exec"), ns)
        except Exception as e:  # name the block so the failing example is easy to find
            raise AssertionError(f"{page.relative_to(ROOT)}, the ```python block at line {line} failed: "
                                 f"{type(e).__name__}: {e}") from e
        ran += 1
    assert ran or all(c.lstrip().startswith("# GPU only") for _, c in blocks(page, "python"))


class _Parsed(Exception):
    def __init__(self, args, extra):
        self.args_, self.extra = args, extra


def parse_cli(command: str) -> argparse.Namespace:
    """Parse one ``yolo-func ...`` command with the parser ``yolo_func.cli.main`` builds; nothing runs.

    Raises AssertionError when argparse refuses it (unknown flag, bad choice, bad value).
    """
    from yolo_func import cli

    argv = shlex.split(command)[1:]
    original = argparse.ArgumentParser.parse_known_args

    def capture(self, args=None, namespace=None):
        result = original(self, args, namespace)
        if self.prog == "yolo-func":  # the top-level parser; subparsers are called from inside it
            raise _Parsed(*result)
        return result

    argparse.ArgumentParser.parse_known_args = capture
    try:
        status = cli.main(argv)
    except _Parsed as p:
        args, extra = p.args_, p.extra
        overrides_only = all("=" in t and not t.startswith("-") for t in extra)  # as main() accepts them
        assert not extra or (args.command == "train" and overrides_only), f"unrecognized arguments {extra} in {command!r}"
        return args
    finally:
        argparse.ArgumentParser.parse_known_args = original
    raise AssertionError(f"argparse refused {command!r} (exit status {status})")


def _bash_commands() -> list[tuple[str, str]]:
    return [(f"{p.name}:{line}", cmd) for p in PAGES for line, code in blocks(p, "bash") for cmd in cli_commands(code)]


@pytest.mark.parametrize("where,command", _bash_commands(), ids=[w for w, _ in _bash_commands()])
def test_cli_commands_in_docs_parse(where, command, capsys):
    args = parse_cli(command)
    assert args.command, f"{where}: {command!r} names no sub-command"


def test_the_parser_check_can_fail(capsys):
    """The CLI check is not vacuous: a made-up flag and a bad value are refused, a good command passes."""
    assert parse_cli("yolo-func train --epochs 1 optim.lr0=0.02").command == "train"
    with pytest.raises(AssertionError, match="unrecognized"):
        parse_cli("yolo-func train --no-such-flag 3")
    with pytest.raises(AssertionError, match="refused"):
        parse_cli("yolo-func val --weights W --data D --out DIR --conf")
    with pytest.raises(AssertionError, match="refused"):
        parse_cli("yolo-func demo --imgsz 33")


def test_block_extraction():
    md = "x\n```python\na = 1\n```\n```bash\nyolo-func demo --imgsz 64 \\\n  --batch 2  # two\necho; yolo-func info\n```\n"
    page = Path(os.environ.get("TMPDIR", "/tmp")) / "_docs_test_page.md"
    page.write_text(md)
    assert blocks(page, "python") == [(2, "a = 1\n")]
    assert cli_commands(blocks(page, "bash")[0][1]) == ["yolo-func demo --imgsz 64    --batch 2", "yolo-func info"]
    page.unlink()
