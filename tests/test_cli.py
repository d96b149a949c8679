"""``yolo-func demo``: bad sizes and batch counts are usage errors (exit 2, one error line)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from yolo_func.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--imgsz", "-32"], "argument --imgsz: expected a positive multiple of 32 (e.g. 640), got -32; try 32"),
        (["--imgsz", "0"], "argument --imgsz: expected a positive multiple of 32 (e.g. 640), got 0; try 32"),
        (["--imgsz", "100"], "argument --imgsz: expected a positive multiple of 32 (e.g. 640), got 100; try 128"),
        (["--imgsz", "6.4e2"], "argument --imgsz: expected a positive multiple of 32 (e.g. 640), got '6.4e2'"),
        (["--batch", "-1"], "argument --batch: expected an integer >= 1, got -1"),
        (["--batch", "0"], "argument --batch: expected an integer >= 1, got 0"),
        (["--batch", "two"], "argument --batch: expected an integer >= 1, got 'two'"),
    ],
)
def test_demo_rejects_bad_sizes_with_exit_2_and_one_line(argv, message, capsys):
    assert main(["demo", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    errors = [line for line in err.splitlines() if "error" in line]
    assert errors == [f"yolo-func demo: error: {message}"]  # one line, argparse style
    assert "Traceback" not in err


def test_demo_runs_with_a_small_valid_size(capsys):
    assert main(["demo", "--imgsz", "32", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "input images (2, 3, 32, 32)" in out
    # 32 px: anchors 4*4 + 2*2 + 1*1 = 21; the detect output holds 4 box + 80 class rows
    assert "inference y: (2, 84, 21)" in out


def test_help_returns_0(capsys):
    assert main(["demo", "--help"]) == 0
    assert "positive multiple of 32" in capsys.readouterr().out


def test_console_exit_status_is_2_for_a_negative_batch():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "yolo_func.cli", "demo", "--batch", "-1"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[-1] == "yolo-func demo: error: argument --batch: expected an integer >= 1, got -1"
    assert "Traceback" not in proc.stderr
