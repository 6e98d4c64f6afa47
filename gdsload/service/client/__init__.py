"""The client of the feed: `RemoteLoader`, the local loader's batches pulled from feed servers.

Reading order for one batch, from `iter(loader)` to the training loop:
1. `loader.py`: `RemoteLoader`, the facade: options (`options.py`: `RetryPolicy`, `Connection`,
   and `stripe.policy.StripePolicy`), its `source.py` source (a served dataset or a Mix of them,
   planned from the servers' `DatasetInfo` as a local `Dataset`/`Mix` is), the plan and the cursor.
   `iter()` makes a `RemoteEpoch` and the receiver it starts from the cursor's position.
2. `epoch.py`: `RemoteEpoch`, the pass the training loop holds: it registers with the cursor and
   moves it as the local `Epoch` does, takes `receive.Delivery` items off its receiver's queue and
   hands them out through `output.py` (`OutputConverter`: fields parsed, torch tensors, `map`).
3. The receiver, in its own thread(s), with what both share in `receive.py` (the queue items, the
   `Receiver` base, `read_batches`: a stream's chunks assembled into whole batches):
   - `single.py`: `SingleReceiver`, one server at a time, failing over through the addresses;
   - `stripe/`: several servers at once. `stripe/schedule.py` decides (`Schedule`: which block of
     which server, hedges, stalls, cold servers; pure, from events), `stripe/worker.py` runs each
     request it decides (`FetchWorker`), `stripe/receiver.py` hands the batches out in plan order.
4. `link.py`: how the receivers reach their servers: addresses (`dns:///`, `unix:`), channels,
   the retry budget (`Attempts`), the per-server counters of `stats()["servers"]`.
5. `bulk.py`: the client's end of the bulk connection (`BulkCall`, read like a gRPC call), under
   `link.py`'s stub; `gdsload.service.protocol.wire` turns the chunks into a batch.

The client never imports the server (`gdsload.service.server`), the local pipeline
(`gdsload.loader`) or the I/O backends (`gdsload.io`): `tests/test_layers.py`.
"""

from gdsload.service.client.loader import RemoteLoader

__all__ = ["RemoteLoader"]
