"""`FetchWorker`: one request slot of one server of a striped epoch. It asks the `Schedule` what to
do (under the receiver's lock), does it over the link (a probe: unary calls; a fetch: a
`StreamBatches` call, gRPC or bulk, read into whole batches) and reports each event back. It
decides nothing itself.
"""

from __future__ import annotations

import time
from typing import Any

import grpc

from gdsload.service.client.receive import Delivery, check_position, read_batches
from gdsload.service.client.stripe import pause
from gdsload.service.client.stripe.actions import EXIT, PROBE, Failure, Wait
from gdsload.service.client.stripe.model import Fetch, Server
from gdsload.service.client.stripe.states import ServerState
from gdsload.service.protocol import status, wire
from gdsload.v1 import feed_pb2 as pb


class FetchWorker:
    """The thread of one request slot of `server`; `rx` is the `StripedReceiver` (its lock,
    conditions, schedule, link and request template)."""

    def __init__(self, rx: Any, server: Server):
        self.rx = rx
        self.server = server

    def run(self) -> None:
        rx, sch = self.rx, self.rx.schedule
        try:
            while not rx.stop.is_set():
                with rx.cond:
                    action = sch.work(self.server, time.monotonic())
                    if action is EXIT:
                        return
                    if isinstance(action, Wait):
                        rx.cond.wait(action.seconds)
                        continue
                if action is PROBE:
                    self.probe()
                else:
                    self.fetch(action)
        except BaseException as exc:  # a bug: hand it to the consumer instead of hanging it
            rx.fail(exc)

    def probe(self) -> None:
        """Ask the server whether it serves our dataset (the id the loader planned with), and
        whether it serves `block_stride`: unary calls bounded by `stall_timeout_s`."""
        rx, srv, link = self.rx, self.server, self.rx.link
        timeout = min(link.deadline_s, rx.policy.stall_timeout_s)
        try:
            stub = link.channels.stub(srv.address, srv.endpoint.tls_name)
            name = rx.template.dataset
            if name and rx.dataset_id:
                info = stub.ListDatasets(pb.ListDatasetsRequest(name=name), timeout=timeout,
                                         metadata=link.metadata).datasets[0]
                if info.dataset_id != rx.dataset_id:
                    with rx.cond:
                        rx.schedule.probe_refused(srv, status.RemoteError(
                            f"{srv.address} serves dataset {name!r} with id {info.dataset_id}, this loader "
                            f"planned with {rx.dataset_id}: another version of the dataset, not used",
                            code="FAILED_PRECONDITION", address=srv.address))
                        rx.settle()
                    return
            server = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=timeout, metadata=link.metadata)
        except grpc.RpcError as err:
            with rx.cond:
                if not (status.is_retryable(err) or status.is_elsewhere(err)):
                    rx.schedule.probe_refused(srv, status.from_rpc_error(err, srv.address))
                else:
                    rx.schedule.probe_failed(srv, str(status.from_rpc_error(err, srv.address)), time.monotonic())
                rx.settle()
            return
        with rx.cond:
            rx.schedule.probe_ok(srv, server.serves_block_stride)
            rx.settle()
        if rx.dataset_id:  # (the loader's later passes start it without a probe: schedule.py)
            link.probed.setdefault(rx.dataset_id, {})[srv.address] = server.serves_block_stride

    def fetch(self, f: Fetch) -> None:
        """Run `f`: one block's steps (`max_batches`), or with `f.stride` this server's blocks from
        here to the epoch's end on one stream (`block_batches`, `block_stride`)."""
        rx, srv, link = self.rx, self.server, self.rx.link
        req = rx.request(f.next * rx.G)
        if f.stride:
            req.block_batches, req.block_stride = rx.policy.stripe_batches, f.stride
        else:
            req.max_batches = f.end - f.next
        try:
            call = link.channels.stub(srv.address, srv.endpoint.tls_name).StreamBatches(
                req, timeout=link.stream_deadline_s, metadata=link.metadata)
            f.call, f.opened = call, True
            if rx.stop.is_set() or f.reason is not None:
                call.cancel()
            self._read(f, call)
            with rx.cond:
                rx.schedule.on_end(f, time.monotonic())
                rx.settle()
        except grpc.RpcError as err:
            with rx.cond:
                if not rx.stop.is_set():
                    rx.schedule.on_failure(f, *_failure(err, srv.address, link), time.monotonic())
                    rx.settle()
        except wire.ProtocolError as exc:
            with rx.cond:
                rx.schedule.on_failure(f, Failure.RETRY, exc, time.monotonic())
                rx.settle()
        finally:
            with rx.cond:
                f.call = None
                rx.schedule.on_finish(f)
                rx.cond.notify_all()

    def _read(self, f: Fetch, call: Any) -> None:
        rx = self.rx

        def waiting(t: float | None) -> None:
            if t is None:
                f.heard(time.monotonic())

        def paused(notice: pb.StreamPause) -> None:  # (higher-priority work, or its job's earlier batches)
            with rx.cond:
                pause.paused(rx.schedule, f, notice.reason, time.monotonic(),
                             own=notice.by_priority == rx.template.priority)
            rx.link.mark(self.server.address, paused_at=time.time())

        for chunk, batch, shared in read_batches(call, rx.link.channels.bodies, rx.stages, waiting, paused):
            expected = (f.next + 1) * rx.G
            check_position(chunk, rx.epoch, expected)
            if f.stride:
                self._hold(f)
            nbytes = wire.body_nbytes(batch)
            with rx.cond:
                d = rx.schedule.on_batch(f, Delivery(batch, expected, nbytes, shared), nbytes, time.monotonic())
                if d.head:
                    rx.arrived.notify()
                if d.whole:
                    rx.cond.notify_all()  # slots may pick the next block
                rx.settle(d.cancel, wake=False)
                if f.stride and f.next >= f.end and f.reason is None:
                    rx.settle(rx.schedule.advance(f, time.monotonic()), wake=False)
            if f.reason is not None:
                break  # cancelled (stall, a hedged copy done, stop): the call is being cancelled

    def _hold(self, f: Fetch) -> None:
        """Wait while `f`'s block lies beyond the window: the stream is not read meanwhile, so its
        server stops (`Schedule.beyond_window`, `on_hold`, `on_held`). The batch that came says
        its server no longer pauses the stream (`pause.resumed`, now, not when the batch is
        counted): the notices it sent while the stream was held lay unread before it, and kept
        the server PAUSED for as long as this hold lasted (no new request for it, its blocks
        taken by the other servers one stream each; traced in `bench/priority_bench.py`: a
        server PAUSED 2.2 s past its pause, the low jobs back 3.6 s after the high job left)."""
        rx, sch = self.rx, self.rx.schedule
        with rx.cond:
            since = now = time.monotonic()
            held = False
            if f.server.state is ServerState.PAUSED and sch.beyond_window(f):
                pause.resumed(sch, f.server, now)
                rx.cond.notify_all()  # (its slots may pick again)
            while not rx.stop.is_set() and sch.beyond_window(f):
                rx.cond.wait(rx.policy.poll_s)
                now = time.monotonic()
                held = True
                rx.settle(sch.on_hold(f, since, now), wake=False)
            if held:
                sch.on_held(f, since, now)


def _failure(err: grpc.RpcError, address: str, link: Any) -> tuple[Failure, BaseException]:
    """What a request's error status means (`Failure`), with the error to report."""
    if status.is_elsewhere(err):
        return Failure.CORRUPT, link.corrupt_everywhere(err, address)
    if err.code() == grpc.StatusCode.FAILED_PRECONDITION:
        return Failure.REFUSED, status.from_rpc_error(err, address)
    if status.is_retryable(err):
        return Failure.RETRY, status.from_rpc_error(err, address)
    return Failure.FATAL, status.from_rpc_error(err, address)
