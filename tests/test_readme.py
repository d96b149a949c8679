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
