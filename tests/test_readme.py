"""The README's commands stay true: CI runs the README's test command, and the notebook example runs."""

import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_cmd = next(b for b in blocks if "pytest" in b)
    tail = test_cmd.split("&& ", 2)[-1]  # after creating/activating the venv
    assert tail in ci, f"CI must run the README's test command {tail!r}"


def test_notebook_example_runs():
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)\n```", readme, re.S).group(1)
    code = code.replace("640, 640", "64, 64")  # same code, smaller images for a fast test
    ns: dict = {}
    with torch.no_grad():
        exec(compile(code, "README.md", "exec"), ns)
    assert ns["out"].y.shape == (1, 116, 84)
    assert ns["preds"]["segment"].protos.shape == (2, 32, 16, 16)


def test_training_step_example_runs_on_cpu():
    """The README's training-step block (after the notebook block that builds ``model``) runs on the
    CPU as written, apart from a smaller image size; it trains (the step counter moves, the loss is
    finite) and, on a CPU-only machine, picks the CPU and the eager level."""
    readme = (ROOT / "README.md").read_text()
    notebook, step_block = re.findall(r"```python\n(.*?)\n```", readme, re.S)[:2]
    assert 'torch.cuda.is_available() else "cpu"' in step_block, "the step example must pick the device"
    code = notebook.replace("640, 640", "64, 64") + "\n" + step_block.replace("(4, 320)", "(2, 64)")
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)
    assert int(ns["ts"].step) == 1 and bool(ns["metrics"]["finite"])
    if not torch.cuda.is_available():
        assert ns["device"] == "cpu" and ns["step"].capture == "none"
