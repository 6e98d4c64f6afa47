"""Many consumers at once: 8 ranks of one epoch, each its own thread and stream, see every sample
exactly once; the server shares one opened dataset between them."""

from __future__ import annotations

import threading
from collections import Counter

from gdsload.service.client import RemoteLoader


def test_eight_ranks_see_every_sample_once(server):
    srv, address = server
    world = 8
    seen: list[list[str]] = [[] for _ in range(world)]
    errors: list[BaseException] = []

    def consume(rank: int) -> None:
        try:
            loader = RemoteLoader(address, dataset="feats", batch_size=4, shuffle=True, seed=9, rank=rank,
                                  world_size=world, output="numpy")
            for batch in loader:
                seen[rank].extend(batch["__key__"])
            loader.close()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    counts = Counter(k for keys in seen for k in keys)
    assert len(counts) == 256 and set(counts.values()) == {1}  # 256 = 8 ranks x 4 x 8 steps
    assert all(len(keys) == 32 for keys in seen)
    # the eight streams shared one opened dataset, and all of them are closed
    catalog = srv.servicer.catalog
    assert catalog.dataset("feats") is catalog.dataset("feats")
    assert srv.servicer.active_streams() == 0
    assert 'gdsload_feed_consumers{dataset="feats"} 0.0' in srv.metrics.text()
