"""Checkpoints: exact round trip, atomic writes, safe loading, clear mismatch errors."""

import os
import pickle
from typing import NamedTuple

import pytest
import torch

from yolo_func import tree as T
from yolo_func import yolov8
from yolo_func.io.checkpoint import FORMAT, load_checkpoint, read_checkpoint, save_checkpoint
from yolo_func.testing import assert_trees_all_equal


class Box(NamedTuple):
    params: dict
    count: torch.Tensor


def _state(scale="n", task="detect"):
    model = yolov8(scale, task=task)
    params, state = model.init(torch.Generator().manual_seed(0))
    return Box({"params": params, "state": state}, torch.tensor(7))


def test_round_trip_is_exact(tmp_path):
    ts = _state()
    path = save_checkpoint(tmp_path / "ck.pt", ts, config={"scale": "n", "task": "detect"}, meta={"epoch": 3})
    template = T.tree_zeros_like(ts)
    loaded, config, meta = load_checkpoint(path, template)
    assert config == {"scale": "n", "task": "detect"} and meta == {"epoch": 3}
    assert T.tree_structure(loaded) == T.tree_structure(ts)
    assert_trees_all_equal(loaded, ts, strict=True)
    assert loaded.count.dtype == torch.int64


def test_loaded_leaves_take_the_template_layout(tmp_path):
    ts = {"w": torch.randn(2, 3, 4, 5)}
    path = save_checkpoint(tmp_path / "ck.pt", ts)
    template = {"w": torch.zeros(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)}
    loaded, _, _ = load_checkpoint(path, template)
    assert loaded["w"].is_contiguous(memory_format=torch.channels_last) and torch.equal(loaded["w"], ts["w"])


def test_another_scale_names_the_mismatching_paths(tmp_path):
    path = save_checkpoint(tmp_path / "s.pt", _state("s"), config={"scale": "s"})
    with pytest.raises(ValueError, match=r"(?s)~ params/params/heads/detect/box/p3/conv1/conv/weight: checkpoint \[64, 128, 3, 3\] != template \[64, 64, 3, 3\].*and \d+ more"):
        load_checkpoint(path, _state("n"))
    path = save_checkpoint(tmp_path / "seg.pt", _state("n", "segment"))
    with pytest.raises(ValueError, match=r"\+ params/params/heads/segment/proto/cv1/conv/weight \(in the checkpoint, not in the template\)"):
        load_checkpoint(path, _state("n"))


def test_write_is_atomic_when_interrupted(tmp_path, monkeypatch):
    path = save_checkpoint(tmp_path / "ck.pt", {"a": torch.ones(3)})
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, {"a": torch.zeros(3)})
    assert path.read_bytes() == before  # the old checkpoint survives intact
    assert os.listdir(tmp_path) == ["ck.pt"]  # and no temporary file is left behind


def test_refuses_foreign_files_and_code(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        read_checkpoint(tmp_path / "missing.pt")
    torch.save({"weights": torch.ones(1)}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=f"not a {FORMAT} checkpoint"):
        read_checkpoint(tmp_path / "other.pt")

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"format": FORMAT, "tensors": {}, "x": Evil()}, f)
    with pytest.raises(Exception):
        read_checkpoint(tmp_path / "evil.pt")
    assert not (tmp_path / "pwned").exists()


def test_truncated_empty_and_foreign_files_are_refused_naming_the_file(tmp_path):
    path = save_checkpoint(tmp_path / "ck.pt", {"a": torch.arange(50_000.0)})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(ValueError, match=rf"checkpoint '{path}' is a torch archive that is truncated or damaged \({len(data) // 3} bytes; "):
        read_checkpoint(path)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"checkpoint '{path}' is empty \(0 bytes\)"):
        read_checkpoint(path)
    path.write_text('{"format": "yolo_func.checkpoint/1"}')
    with pytest.raises(ValueError, match=r"is not a torch checkpoint file \(it starts with b'\{\"format\": \"'\); delete it"):
        read_checkpoint(path)
    torch.save({"format": FORMAT, "tensors": [1, 2]}, path)
    with pytest.raises(ValueError, match=r"has format 'yolo_func.checkpoint/1' but no \{path: tensor\} 'tensors' table"):
        read_checkpoint(path)


def test_extra_round_trips_and_older_files_without_it_load(tmp_path):
    extra = {"format": "x/1", "rng": torch.arange(5, dtype=torch.uint8), "position": {"epoch": 2}}
    path = save_checkpoint(tmp_path / "ck.pt", {"a": torch.ones(2)}, extra=extra)
    payload = read_checkpoint(path)
    assert payload["extra"]["position"] == {"epoch": 2} and torch.equal(payload["extra"]["rng"], extra["rng"])
    torch.save({"format": FORMAT, "tensors": {"a": torch.ones(2)}, "config": {}, "meta": {}}, tmp_path / "old.pt")
    assert read_checkpoint(tmp_path / "old.pt")["extra"] == {}


def test_views_into_a_larger_buffer_are_saved_compactly(tmp_path):
    flat = torch.arange(1_000_000.0)
    tree = {"a": flat[10:20], "b": flat[::100_000]}
    path = save_checkpoint(tmp_path / "ck.pt", tree)
    assert path.stat().st_size < 100_000  # not the 4 MB buffer behind the views
    loaded, _, _ = load_checkpoint(path, T.tree_zeros_like(tree))
    assert torch.equal(loaded["a"], flat[10:20]) and torch.equal(loaded["b"], flat[::100_000])


def test_host_staging_copies_reuses_its_buffers_and_keeps_layouts(tmp_path):
    from yolo_func.io.checkpoint import HostStaging, checkpoint_payload, write_checkpoint_payload

    flat = torch.arange(1_000_000.0)
    conv = torch.randn(8, 3, 3, 3).contiguous(memory_format=torch.channels_last)
    tree = {"conv": conv, "view": flat[10:20], "step": torch.tensor(5)}
    staging = HostStaging()
    first = staging.copy(tree)
    staging.synchronize()
    assert torch.equal(first["conv"], conv) and torch.equal(first["view"], flat[10:20]) and int(first["step"]) == 5
    assert first["conv"].is_contiguous(memory_format=torch.channels_last)  # the layout kept
    assert first["view"].untyped_storage().nbytes() == 10 * 4  # only the view's elements, not the 4 MB buffer
    assert all(first[k].data_ptr() != x.data_ptr() for k, x in tree.items())
    conv.add_(1.0)  # the source changes after the copy: the staged values do not
    assert not torch.equal(first["conv"], conv)
    second = staging.copy(tree)
    assert second["conv"] is first["conv"] and torch.equal(second["conv"], conv)  # refreshed in place
    tree["step"] = torch.zeros(2, dtype=torch.int64)  # another shape: a new buffer
    assert staging.copy(tree)["step"].shape == (2,)
    path = write_checkpoint_payload(tmp_path / "ck.pt", checkpoint_payload(tree, staging=staging))
    loaded, _, _ = load_checkpoint(path, T.tree_zeros_like(tree))
    assert_trees_all_equal(loaded, tree)


@pytest.mark.cuda
def test_host_staging_queues_cuda_copies_ahead_of_later_in_place_changes():
    from yolo_func.io.checkpoint import HostStaging

    dev = torch.device("cuda")
    x = torch.full((4096, 1024), 1.0, device=dev)
    staging = HostStaging()
    torch.cuda._sleep(50_000_000)  # the device is busy: the copy is queued, not done, when copy() returns
    host = staging.copy({"x": x})
    x.fill_(7.0)  # the training stream changes the tensor in place right after
    staging.synchronize()
    assert host["x"].is_pinned() and bool((host["x"] == 1.0).all())
    assert staging.copy({"x": x})["x"] is host["x"]
    staging.synchronize()
    assert bool((host["x"] == 7.0).all())
