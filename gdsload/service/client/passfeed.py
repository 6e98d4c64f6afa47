"""A preprocessing pass's windows decoded on a feed server (`gdsload.process(..., feed=ADDRESS)`).

`WindowFeed(address, priority=, job=)` is what a pass gets as its `feed`: `check(dataset_id)`
asks the server whether it serves window requests (`ServerInfo.serves_windows`) and which of its
datasets is the pass's source (the one with the source's `dataset_id`), and `events(...)` streams
one input shard's events (`BatchRequest.windows`, proto message PassWindows) as
(key, event, data, t) tuples for `gdsload.preprocess.unit`, which turns them into the same
windows a pass decoded here gives. Requests carry the pass's `priority` and `job` and declare
that the pass understands pauses (`BatchRequest.understands_pause`): run training at priority 1
or more and the pass yields to it at every window; the pause notices are counted (`pauses`).

A server older than window requests is refused here, before any call, naming what it lacks;
were a request sent to one anyway, it would refuse it too (its `dataset` is empty, the proto's
rule, and its `batch_size` 0: INVALID_ARGUMENT without a word of `windows`, which a newer server
names in each refusal of one), and that refusal is worded as such (`FeedRefused`).
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from gdsload.errors import GdsloadError, InputError, require

#: Largest message asked of the server (a window of 1080p frames is cut into several).
CHUNK_BYTES = 4 << 20
#: What the channel accepts (a chunk and its header).
_RECEIVE_BYTES = 2 * CHUNK_BYTES
#: Window streams cut short in a row (no event between them) before a pass gives up, and the
#: first wait before asking again (doubled each time, at most 5 s).
RETRIES = 5
RETRY_S = 0.2


class FeedRefused(GdsloadError):
    """The feed server cannot serve a pass's windows (older than window requests) or the pass's
    source."""


class WindowFeed:
    """One feed server as a pass's decoder (module docstring). Picklable (a pass's workers each
    open their own channel) and fork-safe (a channel is opened per process, when first used)."""

    def __init__(self, address: str, *, priority: int = 0, job: str | None = None, token: str | None = None):
        if not isinstance(address, str) or not address:
            raise InputError(f"process(feed={address!r}): a feed server address, HOST:PORT")
        self.address, self.priority, self.token = address, int(priority), token
        self.job = job if job is not None else f"pass-{uuid.uuid4().hex[:12]}"
        self.pauses = 0
        self._pid: int | None = None
        self._stub: Any = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_stub", "_pid", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _stub=None, _pid=None, _lock=threading.Lock())

    def stub(self) -> Any:
        require("grpc", extra="serve", purpose="a pass decoded on a feed server (process(feed=...))")
        import grpc

        from gdsload.v1 import feed_pb2_grpc as pb_grpc

        with self._lock:
            if self._stub is None or self._pid != os.getpid():
                opts = [("grpc.max_receive_message_length", _RECEIVE_BYTES)]
                channel = grpc.insecure_channel(self.address, options=opts)
                self._stub = pb_grpc.FeedStub(channel)
                self._stub.channel = channel
                self._pid = os.getpid()
            return self._stub

    def close(self) -> None:
        """Close this process's channel (a pass closes it before forking its workers, which open
        their own)."""
        with self._lock:
            stub, self._stub, self._pid = self._stub, None, None
        if stub is not None:
            stub.channel.close()

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        from gdsload.service.protocol.auth import metadata

        return metadata(self.token)

    def check(self, dataset_id: str) -> str:
        """The served name of the dataset with `dataset_id` (the pass's source), after checking
        that the server serves window requests; `FeedRefused` naming what is missing."""
        import grpc

        from gdsload.v1 import feed_pb2 as pb

        try:
            info = self.stub().GetServerInfo(pb.GetServerInfoRequest(), metadata=self._metadata(), timeout=30)
            if not info.serves_windows:
                raise FeedRefused(f"the feed server at {self.address} (gdsload {info.version or '?'}) does not serve a "
                                  f"pass's windows (ServerInfo.serves_windows is false: it is older than window "
                                  f"requests); upgrade it, or run the pass without feed=")
            listed = self.stub().ListDatasets(pb.ListDatasetsRequest(), metadata=self._metadata(), timeout=30)
        except grpc.RpcError as exc:
            raise FeedRefused(f"the feed server at {self.address}: {exc.code().name}: {exc.details()}") from None
        for d in listed.datasets:
            if d.dataset_id == dataset_id:
                return d.name
        raise FeedRefused(f"the feed server at {self.address} serves no dataset with id {dataset_id} (the pass's "
                          f"source); it serves {sorted((d.name, d.dataset_id) for d in listed.datasets)[:8]}")

    def request(self, name: str, dataset_id: str, unit: int, spec: dict[str, Any],
                start: tuple[int, int, int]) -> Any:
        """The window request of input shard `unit` from `start` (sample, field, window)."""
        from gdsload.v1 import feed_pb2 as pb

        w = pb.PassWindows(dataset=name, shard=unit, start_sample=start[0], start_field=start[1],
                           start_window=start[2], **spec)
        return pb.BatchRequest(dataset_id=dataset_id, windows=w, max_chunk_bytes=CHUNK_BYTES,
                               priority=self.priority, job=self.job, understands_pause=True)

    def events(self, name: str, dataset_id: str, unit: int, spec: dict[str, Any],
               start: tuple[int, int, int]) -> Iterator[tuple[str, dict[str, Any], Any, Any]]:
        """Input shard `unit`'s events from `start` to its end: (key, event, data, t), data and t
        NumPy arrays for a window (else None). Pause notices are counted, not yielded. A stream
        cut short (it ends without the "end" event: a draining server; or UNAVAILABLE) is asked
        again from the position after its last event, up to `RETRIES` times in a row without an
        event between them."""
        import grpc

        nfields, failures = len(spec["fields"]), 0
        while True:
            got = False
            try:
                for key, ev, data, t in self._stream(name, dataset_id, unit, spec, start):
                    if ev["kind"] == "end":
                        return
                    got, failures = True, 0
                    j, fi = ev["sample"], ev["field"]
                    if ev["kind"] == "win":
                        start = (j, fi, ev["window"] + 1)
                    else:  # the member is done: the next field, or the next sample
                        start = (j, fi + 1, 0) if fi + 1 < nfields else (j + 1, 0, 0)
                    yield key, ev, data, t
                why = "ended before the shard's end"
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise self._refusal(exc) from None
                why = f"UNAVAILABLE: {exc.details()}"
            failures += not got
            if failures > RETRIES:
                raise FeedRefused(f"the feed server at {self.address}: the window stream of shard {unit} {why}, "
                                  f"{failures} times in a row without a window")
            time.sleep(min(RETRY_S * 2 ** failures, 5.0))

    def _stream(self, name: str, dataset_id: str, unit: int, spec: dict[str, Any],
                start: tuple[int, int, int]) -> Iterator[tuple[str, dict[str, Any], Any, Any]]:
        """One call's events (`events`)."""
        from gdsload.service.protocol.wire import ChunkAssembler

        call = self.stub().StreamBatches(self.request(name, dataset_id, unit, spec, start),
                                         metadata=self._metadata())
        asm = ChunkAssembler()
        try:
            for chunk in call:
                if chunk.HasField("pause"):
                    self.pauses += 1
                    continue
                batch = asm.add(chunk)
                if batch is None:
                    continue
                ev = json.loads(bytes(batch["event"].view(0)))
                data, t = batch.get("data"), batch.get("t")
                yield batch["__key__"][0], ev, (data[0] if data is not None else None), \
                    (t[0] if t is not None else None)
        finally:
            call.cancel()

    def _refusal(self, exc: Any) -> GdsloadError:
        import grpc

        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.INVALID_ARGUMENT and "windows" not in details:
            # a server that reads `windows` names it in every refusal of one; an older one sees a
            # request without dataset nor batch size, and says so
            return FeedRefused(f"the feed server at {self.address} refused a pass's window request as one without "
                               f"a dataset or batch size: it is older than window requests ({details}); upgrade "
                               f"it, or run the pass without feed=")
        return FeedRefused(f"the feed server at {self.address}: {code.name}: {details}")

