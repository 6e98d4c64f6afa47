"""The states of a striped epoch's servers and why a request was cancelled, as enums.

`ServerState` changes only along `TRANSITIONS` (`move` raises `IllegalTransition` otherwise); the
value is the word `RemoteLoader.stats()["servers"][address]["state"]` shows.

| from \\ to | why |
| --- | --- |
| NEW → OK, DOWN, REFUSED | its first probe answered, failed, or showed another dataset version |
| OK → SUSPECT | a request of it stalled (`stall_timeout_s` of silence) or was overtaken before it sent anything |
| OK → DOWN | a request of it failed (a retryable status, a protocol error, a stream ended early) |
| OK → REFUSED | it answered FAILED_PRECONDITION (it cannot serve this request) |
| SUSPECT, DOWN → OK | a probe after the backoff answered |
| SUSPECT ↔ DOWN | another request of it stalled or failed meanwhile |
| OK → PAUSED | it holds a request back for higher-priority work (`BatchChunk.pause`; see `pause`) |
| PAUSED → OK | a batch of it came, or none of its requests is left (DOWN if one failed meanwhile) |
| PAUSED → REFUSED | a request it had answered FAILED_PRECONDITION |
| any but GONE → GONE | a `dns:///` name no longer resolves to it (it does not come back within the epoch) |

REFUSED and GONE are final for the epoch: its request slots end.
"""

from __future__ import annotations

from enum import Enum


class ServerState(Enum):
    NEW = "new"  # not probed yet
    OK = "ok"  # gets requests
    SUSPECT = "suspect"  # stalled or overtaken: probed (after a backoff) before it gets work again
    DOWN = "down"  # failed: probed after a backoff
    REFUSED = "refused"  # another dataset version, or cannot serve this request: not asked again
    GONE = "gone"  # no longer resolved
    PAUSED = "paused"  # held back for higher-priority work: no new requests, no hedging, not down


class CancelReason(Enum):
    STALL = "stall"  # silent for stall_timeout_s: its server is suspect
    OVERTAKEN = "overtaken"  # another server's copy of its block was whole before it sent anything
    DONE = "done"  # its block is whole elsewhere (it had sent some), or a stream's next block is not its own
    GONE = "gone"  # its server left
    STOP = "stop"  # the epoch ended, failed or was dropped


_S = ServerState
#: The allowed changes of a server's state (a state to itself is always allowed: no change).
TRANSITIONS: dict[ServerState, frozenset[ServerState]] = {
    _S.NEW: frozenset({_S.OK, _S.DOWN, _S.REFUSED, _S.GONE}),
    _S.OK: frozenset({_S.SUSPECT, _S.DOWN, _S.REFUSED, _S.GONE, _S.PAUSED}),
    _S.SUSPECT: frozenset({_S.OK, _S.DOWN, _S.REFUSED, _S.GONE}),
    _S.DOWN: frozenset({_S.OK, _S.SUSPECT, _S.REFUSED, _S.GONE}),
    _S.PAUSED: frozenset({_S.OK, _S.REFUSED, _S.GONE}),
    _S.REFUSED: frozenset({_S.GONE}),
    _S.GONE: frozenset(),
}
#: States whose request slots end: nothing more is asked of the server in this epoch.
FINAL = frozenset({_S.REFUSED, _S.GONE})


class IllegalTransition(RuntimeError):
    """A change of a server's state the table does not allow: a bug in the schedule."""


def check(old: ServerState, new: ServerState) -> ServerState:
    """`new`, when a server may go from `old` to it (else `IllegalTransition`)."""
    if new is not old and new not in TRANSITIONS[old]:
        raise IllegalTransition(f"a server cannot go from {old.value} to {new.value} (allowed: "
                                f"{sorted(s.value for s in TRANSITIONS[old]) or 'none'})")
    return new
