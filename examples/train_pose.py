"""Train yolov8n-pose (detect + pose heads, 17 keypoints) on the built-in figures data with a
functional loop.

    python examples/train_pose.py                  # CPU: 128 px, batch 4, 40 steps
    python examples/train_pose.py --device cuda    # GPU: 640 px, batch 16, 2000 steps, replayed

init (CPU torch.Generator) -> TrainLoader batches -> ReplayTrainStep (CUDA-graph replay of the
network on the GPU, the eager step on the CPU) -> evaluate the EMA weights -> yolo_func.io checkpoint.
"""

import argparse
import json
from pathlib import Path

import torch

from yolo_func import Targets, yolov8
from yolo_func.data import TrainLoader, builtin_dataset
from yolo_func.eval import evaluate
from yolo_func.io import load_checkpoint, save_checkpoint
from yolo_func.optim import ema
from yolo_func.testing import assert_trees_all_equal
from yolo_func.train import Batch, init_train_state, yolo_sgd
from yolo_func.train.metrics import fetch_metrics
from yolo_func.train.replay import ReplayTrainStep
from yolo_func.tree import tree_to

TASK = "pose"


def to_device(b: Batch, device: str) -> Batch:
    images = b.images.to(device, non_blocking=True)  # uint8; the step divides by 255 on the device
    images = images if images.is_cuda else images.contiguous()  # NCHW on the CPU (loader: NHWC)
    return Batch(images, Targets(*(None if t is None else t.to(device, non_blocking=True) for t in b.targets)))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--imgsz", type=int, help="square training size (default 640 on CUDA, 128 on the CPU)")
    p.add_argument("--batch", type=int, help="batch size (default 16 on CUDA, 4 on the CPU)")
    p.add_argument("--steps", type=int, help="training steps (default 2000 on CUDA, 40 on the CPU)")
    p.add_argument("--images", type=int, help="built-in train images (default 256; val gets half as many)")
    p.add_argument("--out", default=f"runs/examples/{TASK}", help="folder for last.pt and metrics.json")
    a = p.parse_args(argv)
    gpu = torch.device(a.device).type == "cuda"
    imgsz, batch, steps = a.imgsz or (640 if gpu else 128), a.batch or (16 if gpu else 4), a.steps or (2000 if gpu else 40)

    # data: the built-in dataset (generated into ~/.cache/yolo_func on first use) -> augmented batches
    train_ds = builtin_dataset(TASK, "train", num_images=a.images)
    val_ds = builtin_dataset(TASK, "val", num_images=a.images and max(a.images // 2, 1))
    loader = TrainLoader(train_ds, batch_size=batch, image_size=imgsz, workers=4 if gpu else 0, seed=0)

    # init: the model is a value; params and BN statistics are plain dicts drawn from a CPU generator
    model = yolov8("n", task=TASK, num_classes=len(train_ds.names), kpt_shape=train_ds.kpt_shape)
    # the reference recipe; its nominal batch nbs=64 sums round(64 / batch) batches per optimizer step,
    # so short CPU runs use nbs=batch (an optimizer step every batch)
    opt = yolo_sgd(batch_size=batch, batches_per_epoch=len(loader), epochs=-(-steps // len(loader)), nbs=64 if gpu else batch)
    avg = ema()
    ts = init_train_state(model, opt.tx, torch.Generator().manual_seed(0), device=a.device, ema=avg)
    step = ReplayTrainStep(model, opt.tx, ema=avg, capture="network" if gpu else "none")

    # the loop: each head has its own VJP and loss, their feature gradients are summed, one network
    # backward; metrics stay on the device, fetch_metrics (one host sync) every 10 steps
    history = []
    while len(history) < steps:
        for host_batch in loader:
            ts, metrics = step(ts, to_device(host_batch, a.device))
            history.append(metrics["loss"].detach().clone())  # device scalars: no sync here
            if len(history) % 10 == 0 or len(history) == steps:
                m = fetch_metrics({k: metrics[k] for k in ("loss", "step", "finite")})
                print(f"step {len(history):5d}  loss {m['loss']:.4f}", flush=True)
            if len(history) == steps:
                break
    history = torch.stack(history).tolist()

    # eval: pycocotools + the reference's internal metric, on the EMA weights
    weights = {"params": ts.ema.ema["params"], "state": ts.ema.ema["state"]}
    val = evaluate(model, weights["params"], weights["state"], val_ds, image_size=imgsz, batch_size=2 * batch,
                   device=a.device, workers=0, progress=False, verbose=False)
    print(f"val: pose mAP50-95 {val['internal']['pose']['mAP50-95']:.4f}, COCO keypoints AP {val['keypoints']['AP']:.4f}")

    # checkpoint: plain tensors + the config that rebuilds the functions; reload into a fresh template
    out, config = Path(a.out), {"scale": "n", "task": TASK, "num_classes": model.num_classes, "imgsz": imgsz,
                               "kpt_shape": list(train_ds.kpt_shape)}
    save_checkpoint(out / "last.pt", weights, config=config, meta={"steps": steps})
    fresh = yolov8(config["scale"], task=TASK, num_classes=config["num_classes"], kpt_shape=config["kpt_shape"])
    reloaded, _, _ = load_checkpoint(out / "last.pt", dict(zip(("params", "state"), fresh.init(torch.Generator()))))
    assert_trees_all_equal(reloaded, tree_to(weights, "cpu"))  # the round trip is exact
    (out / "metrics.json").write_text(json.dumps({"loss": history, "val": val}, indent=1))
    return {"loss": history, "val": val, "checkpoint": out / "last.pt"}


if __name__ == "__main__":
    main()
