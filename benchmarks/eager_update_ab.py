"""A/B of the update phase (finish_step) with optim.flat recognition on/off, alternating in one process.

    python benchmarks/eager_update_ab.py 64 2      # size batch
"""
import sys, time, statistics; sys.path.insert(0, __import__('os').path.dirname(__file__))
from eager_ops import *
from yolo_func.optim import flat
torch.set_num_threads(1)
size, batch = int(sys.argv[1]), int(sys.argv[2])
model, tx, e, ts, b = build("detect", batch, size, "cpu")
for _ in range(2): ts,_ = train_step(ts, b, model=model, tx=tx, ema=e)
grads, new_state, hb = update_inputs(model, ts, b)
res = {True: [], False: []}
for r in range(15):
    for on in (True, False):
        flat.set_enabled(on)
        t0 = time.perf_counter(); finish_step(ts, grads, new_state, hb.losses, hb.parts, hb.feat_norms, tx=tx, ema=e)
        res[on].append(1000*(time.perf_counter()-t0))
for on in (False, True):
    print(f"{size}px b{batch} update phase, recognition {'on ' if on else 'off'}: median {statistics.median(res[on]):.1f} ms, min {min(res[on]):.1f} ms")
