"""The "Epoch order" sections of feed.proto are enough to reproduce an epoch without gdsload or
NumPy, in either order version: this file implements both from that text alone, in plain Python
integers (no NumPy random, no gdsload.plan), and compares with `gdsload.plan.plan.epoch_order` and
with the server's batches (order 2 asked as the proto says: ';order=2' after the dataset id)."""

from __future__ import annotations

import pytest

M32 = (1 << 32) - 1
M64 = (1 << 64) - 1
M128 = (1 << 128) - 1


def _words32(value: int) -> list[int]:
    out = [value & M32]
    value >>= 32
    while value:
        out.append(value & M32)
        value >>= 32
    return out


def _seed_words(seed: int, epoch: int, *more: int) -> list[int]:
    """Step 1: the pool of 4 words from E, then 8 output words as 4 64-bit words u (`more`: values
    after 0x706C616E in E, order 2's 2)."""
    E = _words32(seed) + _words32(epoch) + _words32(0x706C616E) + [w for v in more for w in _words32(v)]
    h = 0x43B0D7E5

    def hashmix(v: int) -> int:
        nonlocal h
        v ^= h
        h = (h * 0x931E8875) & M32
        v = (v * h) & M32
        return v ^ (v >> 16)

    def mix(x: int, y: int) -> int:
        r = (0xCA01F9DD * x - 0x4973F715 * y) & M32
        return r ^ (r >> 16)

    pool = [hashmix(E[i] if i < len(E) else 0) for i in range(4)]
    for s in range(4):
        for d in range(4):
            if d != s:
                pool[d] = mix(pool[d], hashmix(pool[s]))
    for s in range(4, len(E)):
        for d in range(4):
            pool[d] = mix(pool[d], hashmix(E[s]))
    g = 0x8B51F9DD
    out = []
    for k in range(8):
        v = pool[k % 4] ^ g
        g = (g * 0x58F38DED) & M32
        v = (v * g) & M32
        out.append(v ^ (v >> 16))
    return [out[2 * j] + (out[2 * j + 1] << 32) for j in range(4)]


class _Pcg64:
    """Step 2."""

    M = 0x2360ED051FC65DA44385DF649FCCF645

    def __init__(self, u: list[int]):
        self.inc = (2 * ((u[2] << 64) + u[3]) + 1) & M128
        self.state = (0 * self.M + self.inc) & M128
        self.state = (self.state + (u[0] << 64) + u[1]) & M128
        self.state = (self.state * self.M + self.inc) & M128

    def word(self) -> int:
        self.state = (self.state * self.M + self.inc) & M128
        x = (self.state >> 64) ^ (self.state & M64)
        r = self.state >> 122
        return ((x >> r) | (x << (64 - r))) & M64 if r else x


def _sort_by_group(g: list[int], rng: _Pcg64) -> list[int]:
    """Step 3."""
    w = [rng.word() for _ in g]
    b = max(max(g, default=0).bit_length(), 1)
    key = [(gi << (64 - b)) + (wi >> b) for gi, wi in zip(g, w)]
    return sorted(range(len(g)), key=lambda i: (key[i], i))


def spec_order(shard_sizes: list[int], seed: int, epoch: int, shuffle: bool, window: int) -> list[int]:
    """Step 4."""
    N = sum(shard_sizes)
    if not shuffle:
        return list(range(N))
    rng = _Pcg64(_seed_words(seed, epoch))
    first = [sum(shard_sizes[:s]) for s in range(len(shard_sizes))]
    shard_perm = _sort_by_group([0] * len(shard_sizes), rng)
    stream, place, start = [], [], []
    for q, shard in enumerate(shard_perm):
        start.append(len(stream))
        stream += range(first[shard], first[shard] + shard_sizes[shard])
        place += [q] * shard_sizes[shard]
    perm = _sort_by_group(place, rng)
    stream = [stream[i] for i in perm]
    rounds = [place[i] + (i - start[place[i]]) % window for i in range(N)]
    perm = _sort_by_group(rounds, rng)
    return [stream[i] for i in perm]


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _subkey(key: int, i: int) -> int:
    return _mix64(_mix64((i * 0x9E3779B97F4A7C15 + key) & M64) ^ key)


def _pi(x: int, n: int, key: int) -> int:
    """Order 2, step 3: the permutation pi(x; n, key) of 0..n-1."""
    if n <= 1:
        return x
    base = _mix64(key)
    if n <= 32:
        h = [_mix64(base ^ (((j + 1) * 0xD1B54A32D192ED03) & M64)) for j in range(n)]
        return sum(1 for j in range(n) if h[j] < h[x] or (h[j] == h[x] and j < x))
    b = (n - 1).bit_length()
    hb, lb = (b + 1) // 2, b // 2
    k = [_mix64(base ^ (((i + 1) * 0x9E3779B97F4A7C15) & M64)) for i in range(6)]

    def F(v: int, key: int, bits: int) -> int:
        z = ((v ^ key) * 0xBF58476D1CE4E5B9) & M64
        return (((z ^ (z >> 32)) * 0x94D049BB133111EB) & M64) >> (64 - bits)

    def net(y: int) -> int:
        H, L = y >> lb, y & ((1 << lb) - 1)
        for i in range(6):
            if i % 2 == 0:
                H ^= F(L, k[i], hb)
            else:
                L ^= F(H, k[i], lb)
        return (H << lb) | L

    y = net(x)
    while y >= n:
        y = net(y)
    return y


def spec_order2(shard_sizes: list[int], seed: int, epoch: int, shuffle: bool, window: int) -> list[int]:
    """Order 2, steps 1, 2 and 4."""
    N = sum(shard_sizes)
    if not shuffle:
        return list(range(N))
    rng = _Pcg64(_seed_words(seed, epoch, 2))
    shards = [s for s, n in enumerate(shard_sizes) if n]
    round_key, sample_key = rng.word(), rng.word()
    words = [rng.word() for _ in shards]
    place_shard = [shards[i] for i in sorted(range(len(shards)), key=lambda i: (words[i], i))]
    n = [shard_sizes[s] for s in place_shard]
    S, w = len(place_shard), min(window, max(n))
    first = [sum(shard_sizes[:s]) for s in range(len(shard_sizes))]
    order = []
    for r in range(S + w - 1):
        entries = [(t, i) for t in range(w) if 0 <= r - t < S for i in range(N) if t + w * i < n[r - t]]
        for o in range(len(entries)):
            t, i = entries[_pi(o, len(entries), _subkey(round_key, r))]
            s = place_shard[r - t]
            order.append(first[s] + _pi(t + w * i, shard_sizes[s], _subkey(sample_key, s)))
    return order


@pytest.mark.parametrize("sizes, seed, epoch, window", [
    ([5], 0, 0, 4),
    ([10, 7, 3, 12], 0, 0, 4),
    ([10, 7, 3, 12], 1, 3, 1),
    ([4] * 9, 12345, 7, 2),
    ([3, 0, 8, 1, 6], 2**33 + 5, 2**40, 3),  # empty shard; multi-word seed and epoch
    ([50, 49, 51, 60, 40, 30], 2**70, 9, 16),  # shards over 32: the Feistel network and its walks
    ([300, 1, 0, 77, 33, 2], 5, 1, 3),  # rounds of 1 to ~300 entries, both permutations
    ([2, 3], 9, 0, 100),  # a window over the largest shard deals as one of its size
])
def test_the_documented_order_2_is_the_plan(sizes, seed, epoch, window):
    from gdsload.plan.plan import epoch_order

    want = epoch_order(sizes, seed=seed, epoch=epoch, shuffle=True, window=window, order=2).tolist()
    got = spec_order2(sizes, seed, epoch, True, window)
    assert got == want
    assert sorted(got) == list(range(sum(sizes)))
    assert spec_order2(sizes, seed, epoch, False, window) == list(range(sum(sizes)))


def test_the_documented_permutation_is_permute():
    """Step 3 alone, over the sizes where its two constructions meet and a larger one."""
    import numpy as np

    from gdsload.plan.permute import permute

    for n in (1, 2, 3, 31, 32, 33, 64, 65, 1000):
        for key in (0, 1, 2**64 - 1, 0x1234_5678_9ABC_DEF0):
            want = permute(np.arange(n), n, np.uint64(key)).tolist()
            assert [_pi(x, n, key) for x in range(n)] == want


@pytest.mark.parametrize("sizes, seed, epoch, window", [
    ([5], 0, 0, 4),
    ([10, 7, 3, 12], 0, 0, 4),
    ([10, 7, 3, 12], 1, 3, 1),
    ([4] * 9, 12345, 7, 2),
    ([3, 0, 8, 1, 6], 2**33 + 5, 2**40, 3),  # multi-word seed and epoch: E longer than the pool
    ([50, 49, 51, 60, 40, 30], 2**70, 9, 16),
])
def test_the_documented_algorithm_is_the_plan(sizes, seed, epoch, window):
    from gdsload.plan.plan import epoch_order

    want = epoch_order(sizes, seed=seed, epoch=epoch, shuffle=True, window=window).tolist()
    assert spec_order(sizes, seed, epoch, True, window) == want
    assert spec_order(sizes, seed, epoch, False, window) == list(range(sum(sizes)))


def test_the_documented_order_is_what_the_server_streams(server):
    """Keys of a shuffled 3-rank epoch from the server == the documented order mapped to keys."""
    import grpc

    from gdsload.loader.dataloader import Dataset
    from gdsload.v1 import feed_pb2 as pb
    from gdsload.v1 import feed_pb2_grpc as pb_grpc

    srv, address = server
    stub = pb_grpc.FeedStub(grpc.insecure_channel(address))
    info = stub.ListDatasets(pb.ListDatasetsRequest(name="feats"), timeout=10).datasets[0]
    order = spec_order(list(info.shard_sizes), 77, 2, True, 3)
    ds = Dataset(str(srv.servicer.catalog.dataset("feats").path))
    keys = [ds.shards.index(s).key(j) for s, j in (ds.shards.locate(i) for i in order)]
    W, B = 3, 10
    for r in range(W):
        got = [k for c in stub.StreamBatches(pb.BatchRequest(
                   dataset="feats", batch_size=B, world_size=W, rank=r, seed=77, epoch=2, shuffle=True,
                   shuffle_window=3, drop_last=True, fields=["cls"]), timeout=60)
               if c.chunk_index == 0 for k in c.header.keys]
        end = len(order) // (B * W) * (B * W)
        assert got == keys[r:end:W]


def test_the_documented_order_2_is_what_the_server_streams(server):
    """Keys of a shuffled 3-rank epoch of order 2 (requested as the proto says: the dataset id and
    ';order=2') == the documented order 2 mapped to keys."""
    import grpc

    from gdsload.loader.dataloader import Dataset
    from gdsload.v1 import feed_pb2 as pb
    from gdsload.v1 import feed_pb2_grpc as pb_grpc

    srv, address = server
    stub = pb_grpc.FeedStub(grpc.insecure_channel(address))
    info = stub.ListDatasets(pb.ListDatasetsRequest(name="feats"), timeout=10).datasets[0]
    order = spec_order2(list(info.shard_sizes), 77, 2, True, 3)
    ds = Dataset(str(srv.servicer.catalog.dataset("feats").path))
    keys = [ds.shards.index(s).key(j) for s, j in (ds.shards.locate(i) for i in order)]
    W, B = 3, 10
    for r in range(W):
        got = [k for c in stub.StreamBatches(pb.BatchRequest(
                   dataset="feats", dataset_id=info.dataset_id + ";order=2", batch_size=B, world_size=W, rank=r,
                   seed=77, epoch=2, shuffle=True, shuffle_window=3, drop_last=True, fields=["cls"]), timeout=60)
               if c.chunk_index == 0 for k in c.header.keys]
        end = len(order) // (B * W) * (B * W)
        assert got == keys[r:end:W]
