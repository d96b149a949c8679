"""YOLOv8 parameter groups by path and rank (REFERENCE.md §4.2)."""

from __future__ import annotations

import collections

import pytest
import torch

import yolo_func
from yolo_func import tree as T
from yolo_func.optim import YOLO_GROUPS, partition, sgd, yolo_param_labels


@pytest.fixture(scope="module")
def yolov8n_params():
    params, _ = yolo_func.yolov8("n").init(torch.Generator().manual_seed(0))
    return params


def test_yolov8n_group_counts(yolov8n_params):
    """63 decay (the reference's 64 minus its frozen DFL kernel), 57 BN weights, 63 biases."""
    labels = yolo_param_labels(yolov8n_params)
    counts = collections.Counter(T.tree_leaves(labels))
    assert counts == {"decay": 63, "no_decay": 57, "bias": 63}
    assert set(counts) == set(YOLO_GROUPS)


def test_rules_by_path_and_rank(yolov8n_params):
    """Independent restatement of the rule on every leaf: suffix and rank decide, not order."""
    labels = T.tree_flat_dict(yolo_param_labels(yolov8n_params))
    for path, leaf in T.tree_items(yolov8n_params):
        if path.endswith("/bias"):
            want = "bias"
        elif path.endswith("/bn/weight"):
            want = "no_decay"
            assert leaf.dim() == 1
        else:
            want = "decay"
            assert leaf.dim() >= 2, path
        assert labels[path] == want, path
    # 57 BN betas + 6 head-conv biases make the 63 biases.
    assert sum(p.endswith("/bn/bias") for p in labels) == 57
    assert sum(p.endswith("/bias") and not p.endswith("/bn/bias") for p in labels) == 6


def test_labels_do_not_depend_on_order():
    a = {"z": {"conv": {"weight": torch.zeros(2, 2, 3, 3)}}, "a": {"bn": {"weight": torch.ones(2), "bias": torch.zeros(2)}}}
    b = {"a": a["a"], "z": a["z"]}  # other insertion order
    assert T.tree_flat_dict(yolo_param_labels(a)) == T.tree_flat_dict(yolo_param_labels(b))
    # A 1-D weight outside "bn" is never treated as a kernel; "bias" anywhere is a bias.
    odd = {"scale": {"weight": torch.ones(3)}, "bias": torch.zeros(3), "lin": {"weight": torch.zeros(3, 3)}}
    assert T.tree_flat_dict(yolo_param_labels(odd)) == {"bias": "bias", "lin/weight": "decay", "scale/weight": "no_decay"}


def test_partition_over_yolov8n_routes_decay(yolov8n_params):
    """Only the decayed group sees the parameters: zero gradients give updates -lr*wd*p there only."""
    params = yolov8n_params
    tx = partition({"decay": sgd(1.0, weight_decay=0.5), "no_decay": sgd(1.0), "bias": sgd(1.0)}, yolo_param_labels)
    updates, _ = tx.update(T.tree_zeros_like(params), tx.init(params), params)
    labels = T.tree_flat_dict(yolo_param_labels(params))
    for path, u in T.tree_items(updates):
        p = T.tree_get(params, path)
        if labels[path] == "decay":
            assert torch.equal(u, -(0.5 * p)), path
        else:
            assert not u.any(), path
