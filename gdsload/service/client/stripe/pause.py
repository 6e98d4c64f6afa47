"""A striped epoch's paused servers (issue 49): a server that holds a stream back for work of a
higher priority says so (`BatchChunk.pause`, to a request with `understands_pause`), and the
`Schedule` moves it to `ServerState.PAUSED` (`paused`). A paused server is live but slow, never
failing: its requests in flight are neither hedged elsewhere (`Schedule.straggles`) nor cancelled as
stalled (`Schedule.watch`), its head block does not count down `retry_timeout_s` (`holds_head`), it
gets no new request, and the blocks its stream claims may go to the servers that are not paused
(unless it is paused for its own job's earlier batches: `paused`), though they stay laid out over it
(`Server.laid_out`: the other servers' streams are not begun again at the pause, nor at its end). It
is OK again (`resumed`) at its next batch, or when it has no request left (a failure of a request
keeps it PAUSED, not down: it is DOWN, to be probed after its backoff, once its last request is
over). The time it spent paused and why are in `RemoteLoader.stats()["servers"]` (`pauses`,
`paused_s`, `paused_reason`, `paused_at`).
"""

from __future__ import annotations

from typing import Any

from gdsload.service.client.stripe.states import ServerState

S = ServerState


def paused(sch: Any, f: Any, reason: str, now: float, own: bool = False) -> None:
    """`f`'s server says `f` is paused (`reason`): PAUSED from OK (the notice is also a sign of life).
    `own`: for its job's own earlier batches there (the notice's `by_priority` is the job's).

    Such a pause (a pass opened ahead, held while this epoch's stream on that server wants it) is
    an order, not the server's slowness: the server stays live (`Server.serving`), its claimed
    blocks stay its own, and the time is left out of its pace (`resumed`). Taken for a higher
    job's pause, the held stream was cancelled at its block's end (the live servers changed) and
    the other server, as busy with the job's earlier batches, took its blocks as new requests: at
    a twentieth of a core each a new loader's set-up, and the raw training loop waited 0.1-0.7 s
    10-20 batches into its epochs."""
    srv = f.server
    f.last = now
    if srv.state is S.OK and srv.move(S.PAUSED):
        srv.paused_at = now
        sch.stats.bump(srv.address, pauses=1)
        sch.stats.mark(srv.address, state=S.PAUSED.value, paused_reason=reason)
    if srv.state is S.PAUSED:
        srv.paused_own = own  # (the latest notice says for whom: one every second of a pause)


def resumed(sch: Any, srv: Any, now: float) -> None:
    """`srv` is no longer paused (a batch came, or none of its requests is left): OK again, or
    DOWN when a request of it failed meanwhile and its backoff is not over."""
    if srv.state is S.PAUSED and srv.move(S.OK):
        if srv.paused_own:
            srv.pace.pause(now - srv.paused_at)
        sch.stats.bump(srv.address, paused_s=max(0.0, now - srv.paused_at))
        down = srv.fails > 0 and now < srv.next_try and srv.move(S.DOWN)
        sch.stats.mark(srv.address, state=(S.DOWN if down else S.OK).value)


def holds_head(sch: Any) -> bool:
    """Whether a paused server is fetching the plan-order head block (its wait is not a failure)."""
    return any(f.server.state is S.PAUSED for f in sch.fetchers.get(sch.out // sch.K, ()))
