"""Execute a Jupyter notebook's code cells without Jupyter (stdlib ``json`` + matplotlib only).

    python3 examples/run_notebook.py examples/swap_heads.ipynb --out executed.ipynb
    python3 examples/run_notebook.py examples/swap_heads.ipynb --inplace

Every code cell runs in one shared namespace, in order, in this process (the working directory
and ``sys.path`` are the caller's: run it from the repository root). Per cell, stdout and stderr are captured as ``stream`` outputs, every matplotlib figure
left open is saved as a PNG ``display_data`` output (then closed), the value of a last bare
expression becomes an ``execute_result`` (its ``repr``), and an exception becomes an ``error``
output and stops the run (exit status 1, the partial notebook is still written). Execution counts
are 1, 2, ... The result is nbformat 4 JSON that Jupyter and GitHub render.

Environment variables reach the cells unchanged, so size knobs like ``SWAP_HEADS_STEPS`` work:
``SWAP_HEADS_STEPS=20 python3 examples/run_notebook.py ...``.
"""

from __future__ import annotations

import argparse
import ast
import base64
import contextlib
import io
import json
import os
import sys
import time
import traceback
from pathlib import Path

__all__ = ["run_notebook", "main"]


def _source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _lines(text: str) -> list[str]:
    """nbformat's multiline string: a list of lines, each keeping its newline."""
    return text.splitlines(keepends=True)


def _figures() -> list[dict]:
    """PNG ``display_data`` outputs of every open matplotlib figure (then closed)."""
    if "matplotlib.pyplot" not in sys.modules:
        return []
    import matplotlib.pyplot as plt

    outs = []
    for num in plt.get_fignums():
        fig = plt.figure(num)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight", dpi=fig.dpi)
        outs.append({"output_type": "display_data", "metadata": {},
                     "data": {"image/png": base64.b64encode(buf.getvalue()).decode("ascii"),
                              "text/plain": [f"<Figure size {fig.get_figwidth() * fig.dpi:.0f}x"
                                             f"{fig.get_figheight() * fig.dpi:.0f} with {len(fig.axes)} Axes>"]}})
    plt.close("all")
    return outs


def _run_cell(code: str, ns: dict, filename: str) -> tuple[object, BaseException | None]:
    """Run ``code`` in ``ns``; returns (value of a last bare expression or None, exception or None)."""
    tree = ast.parse(code, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    try:
        exec(compile(tree, filename, "exec"), ns)
        return (eval(compile(last, filename, "eval"), ns) if last is not None else None), None
    except BaseException as e:  # noqa: BLE001 -- recorded as the cell's error output
        return None, e


def run_notebook(path: str | os.PathLike, *, out: str | os.PathLike | None = None, echo: bool = True) -> dict:
    """Execute ``path``'s code cells and return the executed notebook (written to ``out`` if given).

    Args:
      path: an nbformat 4 ``.ipynb`` file.
      out: where to write the executed notebook (None: do not write).
      echo: also copy each cell's output to this process's stdout/stderr while it runs.

    Returns:
      The notebook dict; ``nb["metadata"]["run_notebook"]`` holds ``{"ok", "seconds", "failed_cell"}``.

    Raises:
      ValueError: ``path`` is not an nbformat 4 notebook.
    """
    path = Path(path)
    nb = json.loads(path.read_text())
    if nb.get("nbformat") != 4 or not isinstance(nb.get("cells"), list):
        raise ValueError(f"run_notebook: {str(path)!r} is not an nbformat 4 notebook (nbformat={nb.get('nbformat')!r})")
    os.environ.setdefault("MPLBACKEND", "Agg")  # figures are captured, never shown in a window
    ns: dict = {"__name__": "__main__"}
    count, failed, t0 = 0, None, time.monotonic()
    try:
        for index, cell in enumerate(nb["cells"]):
            if cell.get("cell_type") != "code":
                continue
            count += 1
            if failed is not None:  # cells after a failure are left unexecuted, as Jupyter does
                cell["outputs"], cell["execution_count"] = [], None
                continue
            stdout, stderr = io.StringIO(), io.StringIO()
            tee_out = _Tee(stdout, sys.stdout if echo else None)
            tee_err = _Tee(stderr, sys.stderr if echo else None)
            with contextlib.redirect_stdout(tee_out), contextlib.redirect_stderr(tee_err):
                value, error = _run_cell(_source(cell), ns, f"<cell {count}>")
            outputs = []
            for name, buf in (("stdout", stdout), ("stderr", stderr)):
                if buf.getvalue():
                    outputs.append({"output_type": "stream", "name": name, "text": _lines(buf.getvalue())})
            outputs += _figures()
            if error is not None:
                failed = index
                tb = traceback.format_exception(type(error), error, error.__traceback__)
                outputs.append({"output_type": "error", "ename": type(error).__name__, "evalue": str(error),
                                "traceback": [line.rstrip("\n") for line in tb]})
                if echo:
                    print("".join(tb), file=sys.stderr)
            elif value is not None:
                outputs.append({"output_type": "execute_result", "execution_count": count, "metadata": {},
                                "data": {"text/plain": _lines(repr(value))}})
            cell["outputs"], cell["execution_count"] = outputs, count
    finally:
        if "matplotlib.pyplot" in sys.modules:
            sys.modules["matplotlib.pyplot"].close("all")
    nb.setdefault("metadata", {})["run_notebook"] = {"ok": failed is None, "seconds": round(time.monotonic() - t0, 1),
                                                     "failed_cell": failed}
    nb["nbformat"], nb["nbformat_minor"] = 4, max(int(nb.get("nbformat_minor", 5)), 4)
    if out is not None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    return nb


class _Tee(io.TextIOBase):
    """Writes to a capture buffer and, optionally, to a live stream."""

    def __init__(self, buf: io.StringIO, live):
        self.buf, self.live = buf, live

    def write(self, s: str) -> int:
        self.buf.write(s)
        if self.live is not None:
            self.live.write(s)
        return len(s)

    def flush(self) -> None:
        if self.live is not None:
            self.live.flush()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Execute a notebook's code cells and save it with their outputs.")
    p.add_argument("notebook")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", help="write the executed notebook here")
    g.add_argument("--inplace", action="store_true", help="overwrite the notebook")
    p.add_argument("--quiet", action="store_true", help="do not echo cell output while running")
    a = p.parse_args(argv)
    nb = run_notebook(a.notebook, out=a.notebook if a.inplace else a.out, echo=not a.quiet)
    status = nb["metadata"]["run_notebook"]
    print(f"run_notebook: {'ok' if status['ok'] else 'FAILED at cell ' + str(status['failed_cell'])} "
          f"in {status['seconds']} s -> {a.notebook if a.inplace else a.out}", file=sys.stderr)
    return 0 if status["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
