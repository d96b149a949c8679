"""Dispatched aten ops (and CPU time) of one eager training step, by phase and by op.

    python benchmarks/eager_ops.py                          # op counts: nano detect, 64 px, batch 2
    python benchmarks/eager_ops.py --time --size 320 --batch 8 --repeats 7   # + median CPU step time
    python benchmarks/eager_ops.py --device cuda --size 640 --batch 4 --bf16 --time --repeats 30   # GPU
    # side by side with the reference's eager step (needs ``ultralytics``, e.g. the oracle venv):
    YOLO_OFFLINE=1 YOLO_CONFIG_DIR=$(mktemp -d) PYTHONPATH=$PWD /work/oracle-venv/bin/python \
        benchmarks/eager_ops.py --top 0 --size 320 --batch 8 --time --repeats 9 --reference --reference-trainer

The step is :func:`yolo_func.train.train_step` with the reference recipe: ``yolo_sgd(...).tx``
(clip, three groups of Nesterov SGD, accumulation) and ``ema()``, float32, NCHW on the CPU. Ops are
counted with a ``TorchDispatchMode`` (:func:`yolo_func.testing.count_aten_ops`): every aten op
that reaches the dispatcher's Python mode, i.e. after functorch's transforms and autograd have
done their work, once per kernel-level call (a ``_foreach_*`` call counts one). Phases are the
step's pieces run one after the other on the same inputs (network VJP, heads + assignment + losses,
network pullback, guard + optimizer + EMA).

``--reference`` (with ``--time``) also times the reference package's eager step on the same device,
batch and size, alternating step by step with ours: ``benchmarks/step.py``'s ``ref_nchw`` closure
(its model from ``yolov8n.yaml``, its criterion on a batch dict, ``loss.sum().backward()``, Nesterov
``torch.optim.SGD``, ``zero_grad``; float32 unless ``--bf16``). It does no gradient clipping, no
EMA and no non-finite guard, which ours does. Its synthetic batch has the same boxes (same seed and
box counts) converted to the reference's flat form.

``--reference-trainer`` (with ``--time``) also times the step the reference's *trainer* takes
(shared/REFERENCE.md §4.3: clip the total gradient L2 norm to 10.0 between the backward and the
optimizer step; §4.4: one EMA update of every floating-point state-dict entry after it), the
comparable work to ours: the same closure plus ``torch.nn.utils.clip_grad_norm_`` and an EMA
written with plain public torch (``benchmarks/step.py``'s ``_reference(trainer=True)``; a second
reference model). With both flags the three steps alternate: ours, reference, reference trainer.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from yolo_func import yolov8  # noqa: E402
from yolo_func.optim import ema  # noqa: E402
from yolo_func.testing import count_aten_ops  # noqa: E402
from yolo_func.testing.synthetic import synthetic_batch  # noqa: E402
from yolo_func.structures import Batch  # noqa: E402
from yolo_func.train import init_train_state, train_step, yolo_sgd  # noqa: E402
from yolo_func.train.step import finish_step, heads_backward, network_vjp  # noqa: E402


def build(task: str, batch: int, size: int, device: str, channels_last: bool | None = None, accumulate: int = 1):
    """(model, tx, ema, TrainState, Batch) for one eager step; ``channels_last`` lays the 4-D
    params and the images out NHWC (None: the library's default for ``device``).

    ``accumulate`` > 1: the recipe with the nominal batch ``accumulate * batch`` and the optimizer's
    iteration moved past the warmup (to 10,000, its last step just before), so the calls accumulate
    ``accumulate - 1`` times and then step, as the fit does after its first epochs. 1: the first
    iterations of the warmup, where every call steps."""
    model = yolov8("n", task=task)
    opt = yolo_sgd(batch_size=batch, batches_per_epoch=1000, epochs=100, nbs=batch * accumulate)
    e = ema()
    ts = init_train_state(model, opt.tx, torch.Generator().manual_seed(0), device=device, ema=e,
                          channels_last=channels_last)
    if accumulate > 1:
        guard = ts.opt_state
        ni = torch.full((), 10_000, dtype=torch.int64, device=guard.count.device)
        ts = ts._replace(opt_state=guard._replace(count=ni, inner_state=guard.inner_state._replace(
            count=ni.clone(), last_step=ni - 1)))
    b = synthetic_batch(task, batch, size, num_classes=model.num_classes, max_boxes=8, min_boxes=2, seed=1,
                        device=device)
    if ts.params["network"]["backbone"]["stem"]["conv"]["weight"].is_contiguous(memory_format=torch.channels_last):
        b = Batch(b.images.contiguous(memory_format=torch.channels_last), b.targets)
    return model, opt.tx, e, ts, b


def update_inputs(model, ts, b):
    """``(grads, new_model_state, HeadsBackward)``: what :func:`finish_step` takes, from one eager
    forward and backward of ``ts`` on ``b`` (for timing the update alone)."""
    feats, pull, net_state = network_vjp(model, ts.params["network"], ts.state["network"], b.images)
    hb = heads_backward(model, ts.params["heads"], ts.state["heads"], feats, b.targets)
    (g_net,) = pull(hb.g_feats)
    return {"network": g_net, "heads": hb.head_grads}, {"network": net_state, "heads": hb.head_states}, hb


def phases(model, tx, e, ts, b):
    """Op counts of the step's phases, each run once (same inputs as a whole step)."""
    out = {}
    with count_aten_ops() as c:
        feats, pull, net_state = network_vjp(model, ts.params["network"], ts.state["network"], b.images)
    out["network forward (vjp)"] = c
    with count_aten_ops() as c:
        hb = heads_backward(model, ts.params["heads"], ts.state["heads"], feats, b.targets)
    out["heads + assignment + losses"] = c
    with count_aten_ops() as c:
        (g_net,) = pull(hb.g_feats)
    out["network pullback"] = c
    grads = {"network": g_net, "heads": hb.head_grads}
    new_state = {"network": net_state, "heads": hb.head_states}
    with count_aten_ops() as c:
        finish_step(ts, grads, new_state, hb.losses, hb.parts, hb.feat_norms, tx=tx, ema=e)
    out["guard + optimizer + EMA + metrics"] = c
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--task", default="detect")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--top", type=int, default=25, help="rows of the per-op table")
    ap.add_argument("--time", action="store_true", help="also time --repeats whole steps (median)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave)")
    ap.add_argument("--bf16", action="store_true", help="BF16 autocast (as benchmarks/step.py's eager variant)")
    ap.add_argument("--reference", action="store_true",
                    help="with --time: also time the reference's eager step (benchmarks/step.py's ref_nchw), alternating")
    ap.add_argument("--layouts", nargs="+", choices=("nchw", "nhwc", "loader"), default=["nchw"],
                    help="with --time: memory layouts timed, alternating: nchw / nhwc = params and images both "
                         "contiguous / both channels_last (ours and each reference variant); loader = each "
                         "trainer's own: ours with the library's default params and the channels_last images its "
                         "TrainLoader collates, the reference's NCHW (its loader's stacked batches are contiguous)")
    ap.add_argument("--reference-trainer", action="store_true",
                    help="with --time: also time the reference step plus its trainer's gradient clipping (max norm "
                         "10) and EMA update (REFERENCE.md §4.3-4.4), alternating")
    ap.add_argument("--accumulate", type=int, default=1,
                    help="with --time: step the optimizer every N calls (ours: the recipe past its warmup with the "
                         "nominal batch N * batch; the reference: backward every call, clip + step + EMA every N-th, "
                         "as its trainer); times are per call, over whole cycles")
    ap.add_argument("--vjps", nargs="+", choices=("func", "autograd"), default=["func"],
                    help="with --time: our step with each differentiation backend (train_step(vjp=...)); the first "
                         "is named 'ours', the others 'ours <backend>'")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: time.process_time (this process's CPU time: on a shared VM, less moved by the "
                         "neighbours' load than the wall clock; CPU runs only)")
    ap.add_argument("--keep-freed-host-memory", action="store_true",
                    help="call yolo_func.train.host_memory.keep_freed_host_memory() first, as the fit does on the "
                         "CPU (a process setting: the reference's steps in this process get it too)")
    args = ap.parse_args()
    if args.keep_freed_host_memory:
        from yolo_func.train.host_memory import keep_freed_host_memory

        print(f"keep_freed_host_memory: {keep_freed_host_memory()}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tx, e, ts, b = build(args.task, args.batch, args.size, args.device)
    ac = torch.bfloat16 if args.bf16 else None
    ts, _ = train_step(ts, b, model=model, tx=tx, ema=e, autocast_dtype=ac)  # warm-up (lazy imports, memo tables)
    with count_aten_ops() as total:
        train_step(ts, b, model=model, tx=tx, ema=e, autocast_dtype=ac)
    print(f"# eager step, yolov8n {args.task}, {args.size} px, batch {args.batch}, {args.device}, "
          f"torch {torch.__version__}")
    print(f"total dispatched aten ops: {total.total}")
    for name, c in phases(model, tx, e, ts, b).items():
        print(f"  {name:40s} {c.total:6d}")
    print(f"\ntop {args.top} ops of the whole step:")
    for op, n in collections.Counter(total.by_op).most_common(args.top) if args.top else []:
        print(f"  {n:6d}  {op}")
    if args.time:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        runs = {}
        for layout in args.layouts:
            sfx = {"nchw": "", "nhwc": " nhwc", "loader": " loader"}[layout]
            # loader: the library's default params (None), the images as TrainLoader collates them
            cl = {"nchw": False, "nhwc": True, "loader": None}[layout]
            m_, tx_, e_, ts_, b_ = build(args.task, args.batch, args.size, args.device, channels_last=cl,
                                         accumulate=args.accumulate)
            if layout == "loader":
                b_ = Batch(b_.images.contiguous(memory_format=torch.channels_last), b_.targets)
            for vjp in args.vjps:
                state = {"ts": ts_}

                def ours(state=state, m_=m_, tx_=tx_, e_=e_, b_=b_, vjp=vjp):
                    state["ts"], _ = train_step(state["ts"], b_, model=m_, tx=tx_, ema=e_, autocast_dtype=ac, vjp=vjp)

                ours()  # warm-up (a fresh state's first step)
                runs["ours" + sfx + ("" if vjp == args.vjps[0] else f" {vjp}")] = ours
        refs = []
        if args.reference or args.reference_trainer:
            from step import _reference  # noqa: E402  (benchmarks/step.py)

            kw = dict(device=args.device, size=args.size, autocast_dtype=ac, max_boxes=8, min_boxes=2,
                      accumulate=args.accumulate)
            for layout in dict.fromkeys("nchw" if x == "loader" else x for x in args.layouts):
                cl = layout == "nhwc"
                sfx = " nhwc" if cl else ""
                if args.reference:
                    runs["reference" + sfx] = _reference(args.task, args.batch, cl, **kw)
                    refs.append("reference" + sfx)
                if args.reference_trainer:
                    runs["ref+clip+ema" + sfx] = _reference(args.task, args.batch, cl, trainer=True, **kw)
                    refs.append("ref+clip+ema" + sfx)
        sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

        clock = time.process_time if args.clock == "cpu" else time.perf_counter

        def timed(fn):
            sync()
            t0 = clock()
            fn()
            sync()
            return clock() - t0

        times = {name: [] for name in runs}
        k = max(1, args.accumulate)
        for _ in range(args.repeats + 1):  # the first of each is a warm-up
            for name, fn in runs.items():  # alternating step by step (a whole accumulation cycle each)
                times[name].append(sum(timed(fn) for _ in range(k)) / k)
        times = {name: t[1:] for name, t in times.items()}
        if k > 1:
            print(f"\n(times per call, each the mean over a cycle of {k} calls: {k - 1} accumulating, one stepping)")
        print(f"\nstep {'CPU ' if args.clock == 'cpu' else ''}time over {args.repeats} steps ({torch.get_num_threads()} threads"
              f"{', alternating ' + ', '.join(runs) if len(runs) > 1 else ''}):")
        for name, ts_ in times.items():
            print(f"  {name:18s} median {1000 * statistics.median(ts_):.1f} ms, min {1000 * min(ts_):.1f} ms, "
                  f"all {[round(1000 * t, 1) for t in ts_]}")
        for o in [n for n in runs if n.startswith("ours")]:
            for name in refs:
                paired = statistics.median(a / b for a, b in zip(times[o], times[name]))
                print(f"  {o} / {name} (medians): "
                      f"{statistics.median(times[o]) / statistics.median(times[name]):.3f}"
                      f", (minima): {min(times[o]) / min(times[name]):.3f}"
                      f", (median of the rounds' ratios: each round runs both back to back, so a noisy "
                      f"neighbour slows both alike): {paired:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
