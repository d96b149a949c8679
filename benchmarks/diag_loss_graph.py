"""Is the loss correct when replayed from a CUDA graph at 640 px? Each case in its own process
(a device-side assert poisons the CUDA context):

- ``topk``: ``torch.topk`` over ``[B, M, 8400]`` (its multi-block path) recorded once, replayed on
  new data: equal to eager ``topk`` every time;
- ``assign``: the assigner replayed 6 times: ``fg``, ``gt_idx``, boxes and scores equal eager;
- ``full``: assignment + detect loss + backward replayed 6 times: gradients equal eager.

    python benchmarks/diag_loss_graph.py

Written to find the device assert of the first graph-mode ``loss.py`` run; the cause was the
benchmark itself (its replay closure let the static inputs be freed), not the graph.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from loss import capture, loss_step, make_batch  # noqa: E402

from yolo_func.assign import assign_from_detect  # noqa: E402

CASES = ("topk", "assign", "full")
REPLAYS = 6


def _equal(a, b) -> list[bool]:
    return [bool(torch.equal(x, y)) for x, y in zip(a, b)]


def run_case(name: str, batch: int) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    if name == "topk":
        B, M = (4, 16) if batch == 4 else (64, 32)
        x = torch.rand(B, M, 8400, device="cuda")
        graph, out = capture(lambda: torch.topk(x, 10, dim=-1))
        for i in range(REPLAYS):
            x.copy_(torch.rand(x.shape, device="cuda"))
            graph.replay()
            print("topk replay", i, _equal(out, torch.topk(x, 10, dim=-1)), flush=True)
        return
    if name == "assign":
        dp, _, t, anchors, _ = make_batch("detect", batch, 640, "cuda")
        fn = lambda: assign_from_detect(dp, t, anchors)  # noqa: E731
    else:
        fn = loss_step("detect", batch, 640, "cuda")[0]
    ref = fn()
    graph, out = capture(fn)
    for i in range(REPLAYS):
        graph.replay()
        torch.cuda.synchronize()
        print(name, "replay", i, _equal(out[:4], ref[:4]), flush=True)


def main() -> int:
    if len(sys.argv) > 1:
        run_case(sys.argv[1], int(sys.argv[2]))
        return 0
    for name in CASES:
        for batch in (4, 64):
            r = subprocess.run([sys.executable, __file__, name, str(batch)], capture_output=True, text=True, timeout=120)
            err = [line for line in r.stderr.splitlines() if "Assertion" not in line][-3:]
            print(f"== {name} b{batch} rc={r.returncode}\n{r.stdout}" + "\n".join(err), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
