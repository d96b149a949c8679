"""Child process of ``test_schedule_parity.py``: runs the reference trainer (black box, public API:
callbacks and wrapped trainer / optimizer methods) on the CPU and records, per iteration, what its
training loop did; replays our optimizer and EMA on the reference's own gradients; compares our
first-batch gradients with the reference's. Prints one ``RESULT <json>`` line.

    python tests/train/schedule_ref_child.py '<json spec>'   # spec: see the test's REF_SPEC
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))


def _items(x) -> list:
    vals = x.values() if isinstance(x, dict) else x
    return [float(v) for v in vals]


def main(spec: dict) -> None:
    from _fit_common import torchvision_nms_shim

    torchvision_nms_shim()  # the CPU oracle venv: torchvision's compiled ops may not load
    import torch
    from ultralytics import YOLO

    from yolo_func import tree as T
    from yolo_func import yolov8
    from yolo_func.io import from_reference
    from yolo_func.optim import GradientTransformation, apply_if_finite, apply_updates, ema as make_ema
    from yolo_func.structures.records import Batch
    from yolo_func.structures.targets import targets_from_flat
    from yolo_func.train import init_train_state, train_step, yolo_sgd

    o = spec["optim"]
    ours = yolov8("n", task="detect", num_classes=spec["classes"])
    rows: list[dict] = []
    out: dict = {"rows": rows, "zero_grad_at": [], "replay": [], "grad_check": None}
    st: dict = {"ni": -1, "i": -1, "stepped": False, "pre_step_grads": None, "batch": None, "images": None}

    def ref_trees(module, override: dict | None = None):
        sd = {k: v.detach().clone().float() if v.is_floating_point() else v.clone() for k, v in module.state_dict().items()}
        sd.update(override or {})
        return from_reference(ours, sd)

    def grads_of(module) -> dict:
        return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                for n, p in module.named_parameters() if p.requires_grad}

    def on_train_start(tr) -> None:
        names = {id(p): n for n, p in tr.model.named_parameters()}
        groups = []
        for g in tr.optimizer.param_groups:
            ns = [names[id(p)] for p in g["params"]]
            kind = "decay" if g["weight_decay"] > 0 else ("bias" if all(n.endswith(".bias") for n in ns) else "no_decay")
            groups.append({"kind": kind, "n": len(ns), "weight_decay": g["weight_decay"], "nesterov": g["nesterov"],
                           "dampening": g["dampening"]})
        out["train_start"] = {"nb": len(tr.train_loader), "accumulate": tr.accumulate, "n_train": len(tr.train_loader.dataset),
                              "groups": groups, "type": type(tr.optimizer).__name__}
        st["groups"] = [g["kind"] for g in groups]
        # our optimizer and EMA, replayed on the reference's gradients (same initial weights)
        params, state = ref_trees(tr.model)
        opt = yolo_sgd(batch_size=spec["batch"], batches_per_epoch=len(tr.train_loader), epochs=spec["epochs"],
                       lr0=o["lr0"], lrf=o["lrf"], momentum=o["momentum"], weight_decay=o["weight_decay"],
                       warmup_epochs=o["warmup_epochs"], warmup_bias_lr=o["warmup_bias_lr"],
                       warmup_momentum=o["warmup_momentum"], nbs=o["nbs"])
        ema = make_ema()
        st.update(tx=apply_if_finite(opt.tx), params=params, ema=ema, ema_state=ema.init({"params": params, "state": state}),
                  opt_wd=opt.weight_decay, init_sd={k: v.detach().clone() for k, v in tr.model.state_dict().items()})
        st["opt_state"] = st["tx"].init(params)
        st["acc"] = {n: torch.zeros_like(g) for n, g in grads_of(tr.model).items()}
        out["ours_weight_decay"] = opt.weight_decay
        # spies on the reference's loop, through its public objects
        zero_grad = tr.optimizer.zero_grad

        def zero_grad_spy(*a, **k):
            out["zero_grad_at"].append(st["ni"])
            return zero_grad(*a, **k)

        tr.optimizer.zero_grad = zero_grad_spy
        optimizer_step = tr.optimizer_step

        def optimizer_step_spy(*a, **k):
            g = grads_of(tr.model)
            st["pre_step_grads"] = g
            st["pre_step_norm"] = math.sqrt(sum(float(x.double().pow(2).sum()) for x in g.values()))
            st["stepped"] = True
            return optimizer_step(*a, **k)

        tr.optimizer_step = optimizer_step_spy
        preprocess = tr.preprocess_batch

        def preprocess_spy(batch):
            b = preprocess(batch)
            st["ni"] += 1
            st["i"] += 1
            st["batch"] = b
            return b

        tr.preprocess_batch = preprocess_spy

    def on_epoch_start(tr) -> None:
        st["i"] = -1
        rows.append({"event": "epoch_start", "epoch": tr.epoch})

    def on_batch_end(tr) -> None:
        ni, stepped = st["ni"], st["stepped"]
        g = tr.optimizer.param_groups
        b = st["batch"]
        row = {"epoch": tr.epoch, "i": st["i"], "ni": ni, "images": int(b["img"].shape[0]),
               "lr": {st["groups"][j]: x["lr"] for j, x in enumerate(g)},
               "momentum": {st["groups"][j]: x["momentum"] for j, x in enumerate(g)},
               "accumulate": tr.accumulate, "stepped": stepped, "ema_updates": tr.ema.updates,
               "ema_decay": tr.ema.decay(tr.ema.updates), "loss": float(tr.loss.detach()), "loss_items": _items(tr.loss_items)}
        acc = st["pre_step_grads"] if stepped else grads_of(tr.model)
        micro = {n: acc[n] - st["acc"][n] for n in acc}
        st["acc"] = {n: torch.zeros_like(v) for n, v in acc.items()} if stepped else acc
        if stepped:
            row["grad_norm"] = st["pre_step_norm"]
        # our update on the same micro-batch gradient
        gtree, _ = ref_trees(tr.model, micro)
        upd, st["opt_state"] = st["tx"].update(gtree, st["opt_state"], st["params"])
        st["params"] = apply_updates(st["params"], upd)
        ours_stepped = bool(st["opt_state"].stepped)
        ref_params, ref_state = ref_trees(tr.model)
        st["ema_state"] = st["ema"].update({"params": st["params"], "state": ref_state}, st["ema_state"],
                                           stepped=st["opt_state"].stepped)
        row["ours_stepped"] = ours_stepped
        row["ours_ema_count"] = int(st["ema_state"].count)

        def worst(a, b):
            la, lb = T.tree_leaves(a), T.tree_leaves(b)
            d = max(float((x - y).abs().max()) for x, y in zip(la, lb))
            s = max(float(y.abs().max()) for y in lb)
            return d, s

        row["params_max_abs_diff"], row["params_max_abs"] = worst(st["params"], ref_params)
        ema_p, ema_s = ref_trees(tr.ema.ema)
        row["ema_max_abs_diff"], _ = worst(st["ema_state"].ema, {"params": ema_p, "state": ema_s})
        rows.append(row)
        if ni == 0 and stepped:
            grad_check(tr)
        st["stepped"] = False

    def grad_check(tr) -> None:
        """Our gradients of the reference's first batch from the same initial weights (no step yet)."""
        b = st["batch"]
        params, state = from_reference(ours, {k: v.float() if v.is_floating_point() else v for k, v in st["init_sd"].items()})
        imgs = (b["img"] * 255).round().to(torch.uint8)
        assert torch.equal(imgs.float() / 255, b["img"]), "reference images are not k/255"
        B, _, H, W = imgs.shape
        targets = targets_from_flat(b["batch_idx"], b["cls"], b["bboxes"], batch_size=B, image_size=(H, W))
        seen = {}

        def spy(updates, s, p=None, **kw):
            seen["g"] = updates
            return T.tree_map(torch.zeros_like, updates), s

        tx = GradientTransformation(lambda p: (), spy)
        ts = init_train_state(ours, tx, torch.Generator().manual_seed(0), params=params, state=state)
        _, metrics = train_step(ts, Batch(imgs, targets), model=ours, tx=tx)
        ref_g, _ = ref_trees(tr.model, st["pre_step_grads"])
        num = math.sqrt(sum(float((a - b_).double().pow(2).sum()) for a, b_ in zip(T.tree_leaves(seen["g"]), T.tree_leaves(ref_g))))
        n_ours = math.sqrt(sum(float(a.double().pow(2).sum()) for a in T.tree_leaves(seen["g"])))
        n_ref = math.sqrt(sum(float(a.double().pow(2).sum()) for a in T.tree_leaves(ref_g)))
        out["grad_check"] = {"ours_norm": n_ours, "ref_norm": n_ref, "diff_norm": num, "ref_pre_step_norm": st["pre_step_norm"],
                             "ours_loss": float(metrics["loss"]), "ref_loss": float(tr.loss.detach()), "batch": B,
                             "ours_parts": {k: float(v) for k, v in metrics.items() if k.startswith("loss/")},
                             "ref_loss_items": _items(tr.loss_items)}

    class MosaicLog(logging.Handler):  # the epoch whose start logs "Closing dataloader mosaic"
        def emit(self, record: logging.LogRecord) -> None:
            if "closing dataloader mosaic" in record.getMessage().lower():
                out.setdefault("mosaic_closed_at_epoch", rows[-1]["epoch"] if rows else None)

    logging.getLogger("ultralytics").addHandler(MosaicLog())
    model = YOLO("yolov8n.yaml")
    model.add_callback("on_train_start", on_train_start)
    model.add_callback("on_train_epoch_start", on_epoch_start)
    model.add_callback("on_train_batch_end", on_batch_end)
    model.train(data=spec["data"], epochs=spec["epochs"], batch=spec["batch"], imgsz=spec["imgsz"], workers=0, plots=False,
                device="cpu", project=spec["project"], name="ref", exist_ok=True, seed=0, deterministic=True, val=False,
                amp=False, verbose=False, optimizer="SGD", close_mosaic=spec["close_mosaic"], mosaic=1.0, mixup=0.0,
                copy_paste=0.0, cutmix=0.0, **{k: v for k, v in o.items()})
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
