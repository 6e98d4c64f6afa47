"""Raw batches sent as stored, from the page cache (issue 28: the wire's CPU per byte).

A raw batch over the bulk connection used to cost the server two copies of each byte, its
loader's `preadv` from the page cache into a ring slot and the kernel's copy from there into the
socket, plus the loader's work around them (reader threads, CRC32s, the ring). For a stream
that only moves members as they are stored, that work is not needed: the batch's members are
already in the page cache, and `os.sendfile` hands those pages to the socket. So a stream is
served as stored when all of these hold (otherwise its loader reads it, as before):

- the request is raw (no decode), not shared, not a mix, without media, and goes over the bulk
  connection (gRPC has no way to send from a file): `protocol.request.stored_refusal`, the one
  home of the request combinations;
- the client says it checks the members' CRC32s (`BatchRequest.checks_item_crc32`: the server
  does not see the bytes it sends, so the index's CRC32 of each member travels with it in
  `FieldData.item_crc32` and `wire.decode_body` checks it as the batch lands: a shard changed on
  disk is a `CorruptDataError` on the client, naming the sample, where it was one on the server);
- every field is a stored member (a bytes field) or a label the index holds
  (`BatchPlanner.spans_unsupported`): `.npy` tensors, text and json are parsed by the loader;
- the dataset is in a local folder (an object store's shards are not files here).

The batches are the loader's, byte for byte, in the same order, with the same keys and labels:
the plan's sample ids go through `BatchPlanner.spans` (the loader's own planner, reading
nothing) instead of the loader's readers. A stream served this way allocates no ring; the
server still reserves its loader's memory, as for any stream of its request (a later stream of
the same request may be read by the loader, and takes the parked loader with that reservation).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import numpy as np

from gdsload.service.protocol import wire


#: What `StoredBatches.open` found per loader (dropped with the loader).
_OPENED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class StoredBatches:
    """The batches of one loader's plan as `wire.StoredColumn`s (`batch(ids)`); `open` says
    whether its dataset can be served so."""

    def __init__(self, planner: Any, fds: np.ndarray):
        self.planner = planner  # gdsload.loader.gather.BatchPlanner
        self.fds = fds  # the descriptor of each global shard

    @classmethod
    def open(cls, loader: Any) -> tuple[StoredBatches | None, str]:
        """The stored batches of `loader` (not yet iterated), or (None, why not): its dataset's
        side of the rules (the module docstring); the request's side is
        `gdsload.service.protocol.request.stored_refusal`. Worked out once per loader (a striping
        client's next stream takes the parked loader: its shards' descriptors are the same)."""
        with _LOCK:
            known = _OPENED.get(loader)
        if known is None:
            known = cls._open(loader)
            with _LOCK:
                _OPENED[loader] = known
        return known

    @classmethod
    def _open(cls, loader: Any) -> tuple[StoredBatches | None, str]:
        planner = loader.batch_layout().planner
        why = planner.spans_unsupported()
        if why is not None:
            return None, why
        shards = loader.dataset.shards
        if not hasattr(shards, "local_fd"):
            return None, "the dataset is not in a local folder"
        fds = [shards.local_fd(s) for s in range(len(shards.shards))]
        if None in fds:
            return None, "a shard of the dataset is not a local file"
        return cls(planner, np.array(fds, np.int64)), ""

    def batch(self, ids: np.ndarray) -> dict[str, Any]:
        """Batch `ids` as the loader would give it (its fields in the loader's order, then the keys),
        its bytes fields `wire.StoredColumn`s."""
        sp = self.planner.spans(ids)
        fds = self.fds[sp.shard]
        out: dict[str, Any] = {}
        for name, kind, _ in self.planner.fields:
            if kind == "label":
                out[name] = sp.labels[name]
            else:
                off, size, crc = sp.members[name]
                out[name] = wire.StoredColumn(fds, off, size, crc)
        out[wire.KEY] = sp.keys
        return out
