"""Remote batches equal the local DataLoader's, byte for byte and in order (raw and decoded),
and the two loaders share one state format."""

from __future__ import annotations

import numpy as np
import pytest
from feedkit import assert_same_batches, local_batches

from gdsload.decode.image import ImageTransform
from gdsload.service.client import RemoteLoader

EVAL = ImageTransform(size=32, train=False, resize=36)


@pytest.mark.parametrize("kw", [
    dict(batch_size=8, shuffle=True, seed=3, rank=1, world_size=2, drop_last=False),
    dict(batch_size=5, shuffle=False, rank=0, world_size=3, drop_last=True),
    dict(batch_size=16, shuffle=True, seed=1, shuffle_window=2),
    dict(batch_size=8, shuffle=True, seed=3, rank=1, world_size=2, drop_last=False, order=2),
    dict(batch_size=5, shuffle=True, seed=4, rank=2, world_size=3, drop_last=True, shuffle_window=1, order=2),
    dict(batch_size=8, shuffle=True, seed=3, rank=1, world_size=2, drop_last=False, order=1),
], ids=["shuffle-rank1of2", "ordered-droplast-rank0of3", "window2", "order2-rank1of2", "order2-window1-droplast",
        "order1-rank1of2"])
def test_raw_images_equal_local(server, roots, kw):
    _, address = server
    remote = RemoteLoader(address, dataset="imgs", decode=False, output="numpy", **kw)
    got = list(remote)
    assert_same_batches(got, local_batches(roots / "imgs", decode=False, **kw))
    assert len(remote) == len(got)
    assert remote.stats()["batches"] == len(got)


@pytest.mark.dali
def test_decoded_images_equal_local(server, roots):
    _, address = server
    kw = dict(batch_size=12, shuffle=True, seed=7, rank=0, world_size=2, transform=EVAL)
    remote = RemoteLoader(address, dataset="imgs", decode=True, output="numpy", **kw)
    got = list(remote)
    assert got[0]["jpg"].shape == (12, 3, 32, 32) and got[0]["jpg"].dtype == np.float32
    assert_same_batches(got, local_batches(roots / "imgs", decode=True, **kw))


def test_tensors_torch_output_and_fields_tuple(server, roots):
    torch = pytest.importorskip("torch")
    _, address = server
    kw = dict(batch_size=32, shuffle=True, seed=2, fields=["__key__", "npy", "cls"])
    remote = list(RemoteLoader(address, dataset="feats", output="torch", device="cpu", **kw))
    keys, x, y = remote[0]
    assert isinstance(x, torch.Tensor) and x.dtype == torch.float32 and tuple(x.shape) == (32, 32, 64)
    assert y.dtype == torch.int64 and isinstance(keys, list)
    assert_same_batches(remote, local_batches(roots / "feats", **kw))


def test_state_is_shared_with_the_local_loader(server, roots):
    """A state saved by the local loader mid-epoch resumes remotely (and vice versa)."""
    from gdsload.loader.dataloader import DataLoader, Dataset

    _, address = server
    kw = dict(batch_size=8, shuffle=True, seed=11, decode=False)
    local = DataLoader(Dataset(str(roots / "imgs")), device="cpu", output="numpy", copy=True, **kw)
    local.set_epoch(1)
    it = iter(local)
    head = [next(it) for _ in range(3)]
    state = local.state_dict()
    tail_local = list(it)
    local.close()

    remote = RemoteLoader(address, dataset="imgs", output="numpy", **kw)
    remote.load_state_dict(state)
    assert remote.state_dict() == state
    tail_remote = list(remote)
    assert_same_batches(tail_remote, tail_local)
    assert len(head) + len(tail_remote) == len(remote)
    assert remote.epoch == 2 and remote.state_dict()["position"] == 0

    # and the epoch after, remote == local
    local2 = DataLoader(Dataset(str(roots / "imgs")), device="cpu", output="numpy", copy=True, **kw)
    local2.load_state_dict(remote.state_dict())
    assert_same_batches(list(remote), list(local2))
    local2.close()


def test_set_epoch_and_early_break(server):
    _, address = server
    remote = RemoteLoader(address, dataset="feats", batch_size=64, shuffle=True, output="numpy")
    remote.set_epoch(3)
    first = next(iter(remote))
    assert remote.state_dict()["epoch"] == 3 and remote.state_dict()["position"] == 64
    rest = list(remote)  # a new iteration continues from the cursor, as locally
    assert len(rest) == len(remote) - 1
    keys = first["__key__"] + [k for b in rest for k in b["__key__"]]
    assert len(set(keys)) == 256


@pytest.mark.parametrize("order", [1, 2])
def test_a_state_of_either_order_moves_between_the_loaders(server, roots, order):
    """A state saved mid-epoch by a local loader of order 1 or 2 resumes in a RemoteLoader of the
    same order (its requests name the order) and gives the local loader's remaining batches; a
    loader of the other order refuses it naming both orders, remote as locally."""
    from gdsload.loader.dataloader import DataLoader, Dataset
    from gdsload.plan.plan import StateError

    _, address = server
    kw = dict(batch_size=16, shuffle=True, seed=21, rank=0, world_size=2, decode=False)
    local = DataLoader(Dataset(str(roots / "feats")), device="cpu", output="numpy", copy=True, order=order, **kw)
    it = iter(local)
    [next(it) for _ in range(3)]
    state = local.state_dict()
    assert state["order"] == order
    tail = list(it)
    local.close()
    remote = RemoteLoader(address, dataset="feats", output="numpy", order=order, **kw)
    remote.load_state_dict(state)
    assert_same_batches(list(remote), tail)
    other = 3 - order
    for loader in (RemoteLoader(address, dataset="feats", output="numpy", order=other, **kw),
                   DataLoader(Dataset(str(roots / "feats")), device="cpu", output="numpy", order=other, **kw)):
        with pytest.raises(StateError, match=rf"the state is of order {order}, this loader plans order {other}"):
            loader.load_state_dict(state)
        loader.close()


def test_a_mix_of_order_2_equals_local(server, roots):
    """A Mix of the two served datasets in order 2 (its interleave computed per block on the
    server, `gdsload.plan.interleave`): the local mix's batches, and not order 1's."""
    from gdsload.dataset.mix import Mix
    from gdsload.loader.dataloader import DataLoader, Dataset

    _, address = server
    kw = dict(batch_size=8, shuffle=True, seed=2, rank=1, world_size=2, decode=False, fields=["__key__", "cls"])
    mix = dict(weights=[0.6, 0.4], samples_per_epoch=200)
    remote = list(RemoteLoader(address, dataset=Mix(["imgs", "feats"], **mix), output="numpy", order=2, **kw))
    want = {}
    for order in (1, 2):
        local = DataLoader(Mix([Dataset(str(roots / "imgs")), Dataset(str(roots / "feats"))], **mix), device="cpu",
                           output="numpy", copy=True, order=order, **kw)
        want[order] = list(local)
        local.close()
    assert_same_batches(remote, want[2])
    assert [b[0] for b in want[1]] != [b[0] for b in want[2]]
