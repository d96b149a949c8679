"""``capture_step``: a whole pure step replayed as one CUDA graph, with cloned or donated carry
and persistent inputs read in place."""

import pytest
import torch

from yolo_func import tree as T
from yolo_func.capture import CaptureMismatch, CaptureUnavailable, capture_step, num_captures

pytestmark = pytest.mark.filterwarnings("error::yolo_func.train.replay.CaptureFallbackWarning")


def _step(carry, inputs):
    """A pure SGD-with-momentum step on a least-squares loss (closed-form gradient)."""
    w, m, n = carry["w"], carry["m"], carry["n"]
    x, y = inputs["x"], inputs["y"]
    g = x.T @ (x @ w - y) / x.shape[0]
    m2 = 0.9 * m + g
    return {"w": w - 0.1 * m2, "m": m2, "n": n + 1}, {"loss": ((x @ w - y) ** 2).mean()}


def _carry(device):
    gen = torch.Generator().manual_seed(0)
    return {"w": torch.randn(5, 3, generator=gen).to(device), "m": torch.zeros(5, 3, device=device),
            "n": torch.zeros((), dtype=torch.int64, device=device)}


def _inputs(i, device):
    gen = torch.Generator().manual_seed(100 + i)
    return {"x": torch.randn(8, 5, generator=gen).to(device), "y": torch.randn(8, 3, generator=gen).to(device)}


def test_capture_step_needs_cuda_tensors():
    before = num_captures()
    with pytest.raises(CaptureUnavailable):
        capture_step(_step, _carry("cpu"), _inputs(0, "cpu"))
    assert num_captures() == before  # a refused capture is not counted


def test_capture_step_rejects_bad_warmup():
    with pytest.raises(ValueError, match="warmup"):
        capture_step(_step, _carry("cpu"), _inputs(0, "cpu"), warmup=0)


@pytest.mark.cuda
@pytest.mark.parametrize("donate", [False, True])
def test_replay_equals_eager_cloned_and_donated(donate):
    eager = _carry("cuda")
    carry = _carry("cuda")
    given = T.tree_leaves(carry)
    before = num_captures()
    cap = capture_step(_step, carry, _inputs(0, "cuda"), donate_carry=donate)
    assert num_captures() == before + 1  # capture_step counts like capture_vjp
    static = T.tree_leaves(cap.static.carry)
    if donate:  # the caller's tensors are the static carry
        assert [id(a) for a in static] == [id(b) for b in given]
    else:
        assert len(static) == len(given)
        assert not ({a.data_ptr() for a in static} & {b.data_ptr() for b in given})
    for i in range(5):
        inp = _inputs(i, "cuda")
        eager, aux_e = _step(eager, inp)
        carry, aux_r = cap.step(carry, inp)
        assert carry is cap.static.carry
        for k in eager:
            assert torch.equal(carry[k], eager[k]), (i, k)
        assert torch.equal(aux_r["loss"], aux_e["loss"]), i
    assert int(carry["n"]) == 5


@pytest.mark.cuda
def test_donated_carry_with_a_shared_leaf_gets_distinct_buffers():
    shared = torch.zeros(5, 3, device="cuda")
    carry = {"w": torch.randn(5, 3, device="cuda"), "m": shared, "n": torch.zeros((), dtype=torch.int64, device="cuda")}
    carry["m2"] = shared  # the same tensor twice: the write-back must not write one buffer twice

    def step(c, inp):
        new, aux = _step({k: c[k] for k in ("w", "m", "n")}, inp)
        return {**new, "m2": c["m2"] + 1}, aux

    cap = capture_step(step, carry, _inputs(0, "cuda"), donate_carry=True)
    st = cap.static.carry
    assert st["m"] is shared and st["m2"] is not shared and st["m2"].data_ptr() != shared.data_ptr()
    out, _ = cap.step(st, _inputs(0, "cuda"))
    assert torch.equal(out["m2"], torch.ones(5, 3, device="cuda"))
    assert not torch.equal(out["m"], out["m2"])


@pytest.mark.cuda
def test_persistent_inputs_are_read_in_place_and_never_copied():
    carry = _carry("cuda")
    x = _inputs(0, "cuda")["x"]  # persistent: e.g. another graph's static output, rewritten in place
    cap = capture_step(_step, carry, {"x": x, "y": torch.zeros(8, 3, device="cuda")}, donate_carry=True, persistent=[x])
    assert cap.static.inputs["x"] is x
    eager = T.tree_clone(carry)
    for i in range(3):
        new = _inputs(i + 1, "cuda")
        x.copy_(new["x"])  # updated in place between calls
        eager, _ = _step(eager, new)
        carry, _ = cap.step(carry, {"x": x, "y": new["y"]})
        assert cap.stats.leaves_copied == 1  # y only
        assert torch.equal(carry["w"], eager["w"]), i


@pytest.mark.cuda
def test_other_shapes_raise_capture_mismatch():
    carry = _carry("cuda")
    cap = capture_step(_step, carry, _inputs(0, "cuda"))
    bad = {"x": torch.randn(4, 5, device="cuda"), "y": torch.randn(4, 3, device="cuda")}
    with pytest.raises(CaptureMismatch, match="inputs/x"):
        cap.step(cap.static.carry, bad)


@pytest.mark.cuda
def test_capture_survives_a_busy_helper_thread():
    """A fit captures while its helper threads (checkpoint writer, pinned-memory loader, COCO)
    allocate and sync on their own streams; under torch's default "global" capture mode such a
    call aborts the capture (cudaErrorStreamCaptureInvalidated, seen in the resume test on an
    H200). Captures are thread-local: a thread hammering cudaMalloc, pinned allocations and
    device-to-host syncs during 20 captures leaves every capture and replay exact."""
    import threading

    stop = threading.Event()
    errors: list[BaseException] = []

    def busy() -> None:
        try:
            while not stop.is_set():
                x = torch.empty(1 << 20, device="cuda")  # cudaMalloc once the cache is exhausted
                x.fill_(1.0).sum().item()  # a device-to-host sync on this thread's stream
                torch.empty(1 << 16, pin_memory=True)  # cudaHostAlloc
                del x
                torch.cuda.empty_cache()  # cudaFree: the next empty() mallocs again
        except BaseException as e:  # noqa: BLE001 -- reported by the test
            errors.append(e)

    helper = threading.Thread(target=busy, daemon=True)
    helper.start()
    try:
        for round_ in range(20):
            eager, carry = _carry("cuda"), _carry("cuda")
            cap = capture_step(_step, carry, _inputs(0, "cuda"), donate_carry=True)
            for i in range(3):
                inp = _inputs(i, "cuda")
                eager, _ = _step(eager, inp)
                carry, _ = cap.step(carry, inp)
            for k in eager:
                assert torch.equal(carry[k], eager[k]), (round_, k)
    finally:
        stop.set()
        helper.join(timeout=30)
    assert not errors, errors


def test_gc_paused_restores_the_collector_on_exit_and_on_error():
    """Captures run with the cyclic collector off (a collection inside a capture can run a CUDA
    call that aborts it); the previous setting comes back, also after an exception."""
    import gc

    from yolo_func.capture.binder import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"), gc_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # it was off before: stays off
    finally:
        gc.enable()
