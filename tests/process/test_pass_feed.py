"""`gdsload.process(..., feed=ADDRESS)`: a pass's windows decoded on a real feed server (loopback,
port 0), against the same pass decoded here.

- The output is the local pass's, byte for byte (frames and speech; the server's messages are
  small, so windows travel in several chunks), also when an interrupted feed pass is resumed.
- The request carries the pass's priority and job and declares it understands pauses: the server
  accounts the windows' batches to that priority level (`ServerInfo.priorities`), and a pass at 0
  waits, told so, while training at 1 holds the server's one batch slot, then goes on.
- A server older than window requests is refused clearly: the client refuses it from its
  `ServerInfo` before any call, and a window request sent to it anyway is refused by the server
  (its `dataset` is empty) rather than served as an epoch. The old server is this server with
  what an older parser makes of the request: `BatchRequest.windows` and
  `ServerInfo.serves_windows` unknown to it (dropped).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import passfns
import pytest
from mediakit import assert_same_output, cli_env

pytest.importorskip("grpc")
pytest.importorskip("grpc_health")
pytest.importorskip("prometheus_client")

import gdsload  # noqa: E402
from gdsload.convert.engine import STATE_DIR  # noqa: E402
from gdsload.format import manifest as mf  # noqa: E402
from gdsload.preprocess.unit import FnError  # noqa: E402
from gdsload.service.client.passfeed import FeedRefused, WindowFeed  # noqa: E402
from gdsload.service.server import create_server  # noqa: E402
from gdsload.service.server.servicer import FeedServicer  # noqa: E402


@pytest.fixture(scope="module")
def feed(media_src: Path):
    """A feed server over the pass's source (served as "src"), 64 KiB messages."""
    srv, port = create_server([str(media_src.parent)], max_message_bytes=64 * 1024)
    srv.start()
    yield srv, f"127.0.0.1:{port}"
    srv.shutdown(grace_s=2)


@pytest.mark.parametrize("mode", ["frames", "speech"])
def test_feed_pass_writes_the_local_pass_bytes(media_src: Path, tmp_path: Path, feed, mode) -> None:
    srv, address = feed
    if mode == "frames":
        fn, kw = passfns.frame_stats, dict(frames=(5.0, 2), size=45, batch_size=3, shard_size="16KiB")
    else:
        fn, kw = passfns.speech_stats, dict(speech=0.5, batch_size=4, shard_size="16KiB")
    local = gdsload.process(media_src, tmp_path / "local", fn, **kw)
    remote = gdsload.process(media_src, tmp_path / "feed", fn, feed=address, priority=0, **kw)
    assert_same_output(tmp_path / "feed", tmp_path / "local")
    assert remote["windows"] == local["windows"] > 10 and remote["shards"] == local["shards"] > 3
    assert (remote["members"], remote["fields_without_stream"]) == (local["members"], local["fields_without_stream"])


def test_feed_pass_in_workers_writes_the_same_bytes(media_src: Path, tmp_path: Path, feed) -> None:
    """Run as a user runs it, `gdsload process --feed --workers 2` in a process of its own: the
    workers are forked and each opens its own gRPC channel, which gRPC allows only in a child of
    a process with no gRPC call under way. This pytest process serves the feed (a server is always
    inside gRPC), so a pass forked from here hung now and then (gRPC: "Other threads are currently
    calling into gRPC, skipping fork() handlers")."""
    _, address = feed
    gdsload.process(media_src, tmp_path / "local", passfns.frame_stats, frames=(5.0, 2), size=45, batch_size=3,
                    shard_size="16KiB")
    here = Path(__file__).parent
    env = cli_env()
    p = subprocess.run([sys.executable, "-m", "gdsload", "process", str(media_src), str(tmp_path / "feed"), "--fn",
                        "passfns:frame_stats", "--frames", "5:2", "--size", "45", "--batch-size", "3",
                        "--shard-size", "16KiB", "--feed", address, "--workers", "2", "--json",
                        str(tmp_path / "s.json")], cwd=here, env=env, capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    assert json.loads((tmp_path / "s.json").read_text())["workers"] == 2
    assert_same_output(tmp_path / "feed", tmp_path / "local")


def test_feed_pass_is_sent_at_its_priority(media_src: Path, tmp_path: Path, feed) -> None:
    srv, address = feed
    before = {u.priority: u.batches for u in srv.servicer.arbiter.usage()}
    wf = WindowFeed(address, priority=7)
    sent = wf.request("src", "x", 0, {"mode": "speech", "chunk_s": 1.0, "fields": ["flac"]}, (0, 0, 0))
    assert (sent.priority, sent.understands_pause, sent.job) == (7, True, wf.job) and sent.job
    assert not sent.dataset and sent.windows.dataset == "src"
    r = gdsload.process(media_src, tmp_path / "p", passfns.speech_stats, speech=1.0, fields=["flac"], feed=wf)
    after = {u.priority: u.batches for u in srv.servicer.arbiter.usage()}
    units = len(gdsload.ShardedDataset(media_src).shards)  # a stream per input shard
    events = r["windows"] + r["members"]  # one batch per window and per member's end
    # and per stream its "end" event, and its last turn (the source says it is done) unless the
    # client's cancel after "end" came first
    assert events + units <= after.get(7, 0) - before.get(7, 0) <= events + 2 * units
    assert events > units
    assert after.get(0, 0) == before.get(0, 0)  # nothing of it ran at the default level


def test_feed_pass_resumes_to_the_same_bytes(media_src: Path, tmp_path: Path, feed) -> None:
    """A feed pass stopped by its fn mid-way continues with resume=True from its last recorded
    shard (a window request from a position inside a member) to the uninterrupted pass's bytes."""
    _, address = feed
    kw = dict(frames=(5.0, 2), size=45, batch_size=2, shard_size="16KiB")
    Flaky.fail_at = None
    gdsload.process(media_src, tmp_path / "local", Flaky, **kw)  # (the manifest names fn)
    Flaky.calls, Flaky.fail_at = 0, 12
    with pytest.raises(FnError, match="stop here"):
        gdsload.process(media_src, tmp_path / "feed", Flaky, feed=address, **kw)
    assert list((tmp_path / "feed" / STATE_DIR / "done").iterdir())  # shards kept for the resume
    Flaky.fail_at = None
    r = gdsload.process(media_src, tmp_path / "feed", Flaky, feed=address, resume=True, **kw)
    assert r["outputs"] > 0
    assert_same_output(tmp_path / "feed", tmp_path / "local")


class Flaky:
    """`passfns.frame_stats` that raises at its `fail_at`-th call (class state: one instance per
    process, the same `module:qualname` in both runs)."""

    calls = 0
    fail_at: int | None = None

    def __call__(self, b: dict) -> list:
        type(self).calls += 1
        if type(self).fail_at is not None and type(self).calls >= type(self).fail_at:
            raise RuntimeError("stop here")
        return passfns.frame_stats(b)


@pytest.fixture
def old_feed(media_src: Path, monkeypatch):
    """This server as one older than window requests sees them (the fields dropped)."""
    stream, info = FeedServicer.StreamBatches, FeedServicer.GetServerInfo

    def old_stream(self, request, context):
        request.ClearField("windows")
        yield from stream(self, request, context)

    def old_info(self, request, context):
        got = info(self, request, context)
        got.ClearField("serves_windows")
        return got

    monkeypatch.setattr(FeedServicer, "StreamBatches", old_stream)
    monkeypatch.setattr(FeedServicer, "GetServerInfo", old_info)
    srv, port = create_server([str(media_src.parent)])
    srv.start()
    yield srv, f"127.0.0.1:{port}"
    srv.shutdown(grace_s=2)


def test_an_older_server_is_refused_clearly(media_src: Path, tmp_path: Path, old_feed) -> None:
    srv, address = old_feed
    with pytest.raises(FeedRefused, match=r"does not serve a pass's windows .*serves_windows is false.*older"):
        gdsload.process(media_src, tmp_path / "x", passfns.speech_stats, speech=1.0, feed=address)
    assert not (tmp_path / "x" / "manifest.json").exists()
    # sent anyway: the old server refuses it (no dataset named) instead of serving an epoch
    ds_id = mf.dataset_id(gdsload.ShardedDataset(media_src).shards)
    wf = WindowFeed(address)
    with pytest.raises(FeedRefused, match=r"refused a pass's window request .*older than window requests"):
        list(wf.events("src", ds_id, 0, {"mode": "speech", "chunk_s": 1.0, "fields": ["flac"]}, (0, 0, 0)))


def test_the_feed_must_serve_the_source(media_src: Path, tmp_path: Path, feed) -> None:
    _, address = feed
    wf = WindowFeed(address)
    assert wf.check(mf.dataset_id(gdsload.ShardedDataset(media_src).shards)) == "src"
    with pytest.raises(FeedRefused, match=r"serves no dataset with id 0123"):
        wf.check("0123456789abcdef")


SEEN: list[int] = []


def counted_speech(b: dict) -> list:
    """`passfns.speech_stats`, counting its calls (`SEEN`)."""
    SEEN.append(len(b["window"]))
    return passfns.speech_stats(b)


def _until(cond, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def test_a_pass_yields_to_training_and_goes_on(media_src: Path, tmp_path: Path) -> None:
    """On a server that makes one batch at a time, training at priority 1 holding its slot pauses
    the pass (priority 0) at its first window: the pass is told (pause notices), `fn` sees nothing
    meanwhile; once training lets go, the pass goes on to the local pass's bytes."""
    srv, port = create_server([str(media_src.parent)], batch_slots=1, max_message_bytes=64 * 1024)
    srv.start()
    try:
        training = srv.servicer.arbiter.enter(("test", "training"), 1)
        assert training.wait(lambda: False) is None  # it holds the one slot
        wf = WindowFeed(f"127.0.0.1:{port}", priority=0)
        SEEN.clear()
        done: dict = {}

        def run() -> None:
            try:
                done["r"] = gdsload.process(media_src, tmp_path / "feed", counted_speech, speech=1.0,
                                            fields=["flac"], feed=wf)
            except BaseException as exc:  # noqa: BLE001 - shown by the assertion below
                done["error"] = exc

        t = threading.Thread(target=run, daemon=True)
        t.start()
        arb = srv.servicer.arbiter
        _until(lambda: wf.pauses >= 2, "two pause notices to the pass")
        assert sum(u.paused for u in arb.usage() if u.priority == 0) == 1
        assert SEEN == [] and "r" not in done
        training.made()
        training.leave()
        t.join(60)
        assert not t.is_alive() and "error" not in done, done
    finally:
        srv.shutdown(grace_s=2)
    gdsload.process(media_src, tmp_path / "local", counted_speech, speech=1.0, fields=["flac"])
    assert_same_output(tmp_path / "feed", tmp_path / "local")
    assert done["r"]["windows"] > 5


def test_a_window_stream_cut_short_is_asked_again_from_its_last_event(media_src: Path, tmp_path: Path, feed,
                                                                      monkeypatch) -> None:
    """A stream that ends without its "end" event (as a draining server ends streams at a batch
    boundary) is asked again from the position after its last event: the same bytes as here,
    across two cuts (the first inside a member's windows)."""
    from gdsload.service.server import windows

    _, address = feed
    real = windows.WindowSource.next
    made = {"events": 0, "cuts": 0}

    def draining(self):
        made["events"] += 1
        if made["events"] in (5, 9):  # the 5th and 9th events of the pass: end the stream there
            made["cuts"] += 1
            self.events.close()
            return None
        return real(self)

    monkeypatch.setattr(windows.WindowSource, "next", draining)
    kw = dict(frames=(5.0, 2), size=45, batch_size=3, shard_size="16KiB")
    gdsload.process(media_src, tmp_path / "local", passfns.frame_stats, **kw)
    gdsload.process(media_src, tmp_path / "feed", passfns.frame_stats, feed=address, **kw)
    assert made["cuts"] == 2
    assert_same_output(tmp_path / "feed", tmp_path / "local")


def test_errors_and_limits_are_the_local_pass_s(media_src: Path, tmp_path: Path) -> None:
    """A member that does not decode and members over max_hours: with on_error='skip' the same
    rejected.jsonl (reasons included) and outputs as the local pass."""
    import shutil

    src = tmp_path / "root" / "src"
    shutil.copytree(media_src, src)
    ds = gdsload.open_dataset(src)
    s, j = ds.locate(ds.keys().index("v0"))
    off, n = next((o, n) for e, o, n in ds.index(s).members(j) if e == "mp4")
    with open(src / ds.shards[s]["name"], "r+b") as f:
        f.seek(off)
        f.write(b"\x00" * n)  # no container at all
    srv, port = create_server([str(src.parent)])
    srv.start()
    try:
        kw = dict(frames=(1.0, 2), on_error="skip", max_hours=3.1 / 3600)
        gdsload.process(src, tmp_path / "local", passfns.frame_stats, **kw)
        gdsload.process(src, tmp_path / "feed", passfns.frame_stats, feed=f"127.0.0.1:{port}", **kw)
    finally:
        srv.shutdown(grace_s=2)
    rejected = [json.loads(x) for x in (tmp_path / "feed" / "rejected.jsonl").read_text().splitlines()]
    assert {x["key"] for x in rejected} == {"v0", "v2", "v5"}
    assert_same_output(tmp_path / "feed", tmp_path / "local")


def test_a_feed_that_wants_a_token_gets_the_passs_token(media_src: Path, tmp_path: Path) -> None:
    """A server with a token: the pass given it (`feed_token=`, or `--feed-token-file` on the
    command line) writes the local pass's bytes; without it the pass fails naming the refusal and
    publishes nothing."""

    srv, port = create_server([str(media_src.parent)], token="s3cret")
    srv.start()
    address = f"127.0.0.1:{port}"
    kw = dict(speech=1.0, fields=["flac"], batch_size=4, shard_size="16KiB")
    try:
        gdsload.process(media_src, tmp_path / "local", passfns.speech_stats, **kw)
        gdsload.process(media_src, tmp_path / "feed", passfns.speech_stats, feed=address, feed_token="s3cret", **kw)
        assert_same_output(tmp_path / "feed", tmp_path / "local")
        with pytest.raises(FeedRefused, match="UNAUTHENTICATED: this server needs a bearer token"):
            gdsload.process(media_src, tmp_path / "none", passfns.speech_stats, feed=address, **kw)
        assert not (tmp_path / "none" / "manifest.json").exists()
        with pytest.raises(gdsload.errors.InputError, match="feed_token"):
            gdsload.process(media_src, tmp_path / "x", passfns.speech_stats, feed=WindowFeed(address),
                            feed_token="s3cret", **kw)
        (tmp_path / "token").write_text("s3cret\n")
        here = Path(__file__).parent
        env = cli_env()
        p = subprocess.run([sys.executable, "-m", "gdsload", "process", str(media_src), str(tmp_path / "cli"), "--fn",
                            "passfns:speech_stats", "--speech", "1", "--fields", "flac", "--batch-size", "4",
                            "--shard-size", "16KiB", "--feed", address, "--feed-token-file", str(tmp_path / "token"),
                            "-q"], cwd=here, env=env, capture_output=True, timeout=120)
        assert p.returncode == 0, p.stderr.decode()
        assert_same_output(tmp_path / "cli", tmp_path / "local")
    finally:
        srv.shutdown(grace_s=2)
