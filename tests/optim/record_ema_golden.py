"""Record the reference EMA (ultralytics ModelEMA, used as a black box) on a tiny Conv+BN module.

Run with the oracle venv (see ../shared/ORACLE.md):

    YOLO_OFFLINE=1 YOLO_CONFIG_DIR=/tmp/ycfg .oracle/bin/python tests/optim/record_ema_golden.py

Writes ``tests/optim/goldens/ema_reference.pt``: the model's floating state dict after each of
``STEPS`` random changes and the reference EMA's floating state dict after each ``update``.
"""

from __future__ import annotations

from pathlib import Path

import torch

STEPS = 5
OUT = Path(__file__).with_name("goldens") / "ema_reference.pt"


def float_sd(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items() if v.dtype.is_floating_point}


def main() -> None:
    from ultralytics.utils.torch_utils import ModelEMA  # the oracle venv only

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    ref = ModelEMA(net)
    record = {"init": float_sd(net), "models": [], "emas": [], "updates": []}
    for _ in range(STEPS):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
            net[1].running_mean.add_(torch.randn(4))
            net[1].running_var.add_(torch.rand(4))
        ref.update(net)
        record["models"].append(float_sd(net))
        record["emas"].append(float_sd(ref.ema))
        record["updates"].append(int(ref.updates))
    OUT.parent.mkdir(exist_ok=True)
    torch.save(record, OUT)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
