"""Every transform of yolo_func.optim rejects an extra keyword it does not read (no silent drop),
names itself in the error, and accepts ``iteration``."""

import pytest
import torch

from yolo_func.optim import (
    adamw,
    add_decayed_weights,
    apply_if_finite,
    chain,
    clip_by_global_norm,
    ema,
    identity,
    multi_steps,
    partition,
    scale,
    scale_by_adam,
    scale_by_adamw,
    scale_by_learning_rate,
    scale_by_schedule,
    sgd,
    share_schedules,
    trace,
    yolo_param_labels,
)
from yolo_func.train import yolo_sgd

from optim_helpers import small_params

SCHED = lambda ni: 0.1 + 0.0 * ni.double()  # noqa: E731

TRANSFORMS = {
    # name in the error message: factory
    "identity": lambda: identity(),
    "trace": lambda: trace(0.9),
    "add_decayed_weights": lambda: add_decayed_weights(1e-3),
    "scale": lambda: scale(2.0),
    "scale_by_learning_rate": lambda: scale_by_learning_rate(0.1),
    "scale_by_learning_rate ": lambda: scale_by_learning_rate(SCHED),  # the schedule variant
    "scale_by_schedule": lambda: scale_by_schedule(SCHED),
    "scale_by_adam": lambda: scale_by_adam(),
    "scale_by_adamw": lambda: scale_by_adamw(1e-3),
    "clip_by_global_norm": lambda: clip_by_global_norm(1.0),
    "chain": lambda: chain(scale(2.0), trace(0.5)),
    "partition": lambda: partition({g: scale(1.0) for g in ("decay", "no_decay", "bias")}, yolo_param_labels),
    "sgd": lambda: sgd(0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "sgd ": lambda: share_schedules(sgd(0.1)),  # share_schedules forwards: the inner names itself
    "adamw": lambda: adamw(1e-3),
    "multi_steps": lambda: multi_steps(sgd(0.1), every=2),
    "multi_steps ": lambda: yolo_sgd(batch_size=2, batches_per_epoch=4, epochs=2).tx,
    "apply_if_finite": lambda: apply_if_finite(sgd(0.1)),
}


@pytest.mark.parametrize("label", sorted(TRANSFORMS))
def test_unknown_keyword_raises_naming_the_transform(label):
    tx = TRANSFORMS[label]()
    p = small_params()
    s = tx.init(p)
    name = label.strip()
    with pytest.raises(TypeError, match=rf"^\[yolo_func\] {name}\.update got an unexpected keyword 'foo'; it accepts ('finite', )?'iteration'"):
        tx.update(p, s, p, foo=1)
    # the old veto keyword that only multi_steps read: now refused everywhere except by its owner
    with pytest.raises(TypeError, match=r"unexpected keyword 'skip'.*apply_if_finite\(tx\)"):
        tx.update(p, s, p, skip=torch.tensor(True))
    # the protocol keyword is accepted by all
    u, _ = tx.update(p, s, p, iteration=torch.zeros((), dtype=torch.int64))
    assert set(u) == set(p)


def test_the_keyword_is_rejected_inside_a_combinator_too():
    """A keyword the combinator does not forward never reaches (or silently skips) an inner one."""
    tx = chain(multi_steps(sgd(0.1), every=1))
    p = small_params()
    with pytest.raises(TypeError, match=r"^\[yolo_func\] chain\.update got an unexpected keyword 'finite'"):
        tx.update(p, tx.init(p), p, finite=torch.tensor(False))


def test_ema_accepts_only_stepped():
    e = ema()
    p = small_params()
    s = e.init(p)
    with pytest.raises(TypeError, match=r"^\[yolo_func\] ema\.update got an unexpected keyword 'skip'; it accepts 'stepped'"):
        e.update(p, s, skip=torch.tensor(True))
    assert int(e.update(p, s, stepped=torch.tensor(False)).count) == 0
