"""`RemoteLoader`'s option groups (`gdsload.service.client.options`: `Connection`, `RetryPolicy`;
`stripe.StripePolicy`): each frozen and self-validating, taken as an object or as the keywords of
its fields (every keyword of before still works, with the same error naming the option), never
both for one option. No connection is made here."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("grpc")

from gdsload.errors import ConfigError, GdsloadError
from gdsload.service.client import RemoteLoader
from gdsload.service.client.options import Connection, RetryPolicy
from gdsload.service.client.stripe import StripePolicy
from gdsload.service.protocol.config import Keepalive

ADDR = "127.0.0.1:1"  # nothing listens: nothing here connects


def make(**kw) -> RemoteLoader:
    return RemoteLoader(ADDR, dataset="feats", output="numpy", **kw)


def test_keywords_and_objects_give_the_same_groups():
    by_kw = make(retry_timeout_s=9, max_retries=2, backoff_s=0.5, max_backoff_s=4, deadline_s=7, token="t",
                 stream_deadline_s=60, max_message_bytes=1 << 20, keepalive=Keepalive(time_ms=5000), bulk=False,
                 stripe_batches=3, server_window=1, stall_timeout_s=2, resolve_interval_s=1)
    by_obj = make(retry=RetryPolicy(retry_timeout_s=9, max_retries=2, backoff_s=0.5, max_backoff_s=4),
                  connection=Connection(deadline_s=7, token="t", stream_deadline_s=60, max_message_bytes=1 << 20,
                                        keepalive=Keepalive(time_ms=5000), bulk=False),
                  striping=StripePolicy(stripe_batches=3, server_window=1, stall_timeout_s=2, resolve_interval_s=1))
    for lo in (by_kw, by_obj):
        assert lo.retry == RetryPolicy(9.0, 2, 0.5, 4.0)
        assert (lo.connection.deadline_s, lo.connection.bulk, lo.striping.stripe_batches) == (7.0, False, 3)
    assert by_kw.retry == by_obj.retry and by_kw.connection == by_obj.connection
    assert by_kw.striping == by_obj.striping
    copy = pickle.loads(pickle.dumps(by_obj))  # the groups travel with the loader's configuration
    assert (copy.retry, copy.connection, copy.striping) == (by_obj.retry, by_obj.connection, by_obj.striping)


@pytest.mark.parametrize("kw, message", [
    ({"retry": RetryPolicy(), "backoff_s": 1.0}, r"backoff_s: given as a keyword and in retry=RetryPolicy\(...\)"),
    ({"connection": Connection(), "token": "x", "bulk": False}, "token, bulk: given as keywords and in connection="),
    ({"striping": StripePolicy(), "stall_timeout_s": 1}, "stall_timeout_s: given as a keyword and in striping="),
    ({"retry": {"retry_timeout_s": 5}}, "retry must be a gdsload.service.client.options.RetryPolicy"),
])
def test_an_option_in_both_places_or_a_wrong_group_is_refused(kw, message):
    with pytest.raises(ConfigError, match=message):
        make(**kw)


def test_a_keyword_left_at_its_default_beside_an_object_is_no_conflict():
    lo = make(retry=RetryPolicy(retry_timeout_s=3), backoff_s=0.1, striping=StripePolicy(server_window=1),
              server_window=2)
    assert lo.retry.retry_timeout_s == 3.0 and lo.striping.server_window == 1


@pytest.mark.parametrize("kw, message", [  # every check of before, naming the option as before
    ({"deadline_s": 0}, "deadline_s must be > 0 seconds, got 0"),
    ({"stream_deadline_s": -1}, "stream_deadline_s must be > 0 seconds, got -1"),
    ({"retry_timeout_s": float("nan")}, "retry_timeout_s must be > 0 seconds, got nan"),
    ({"backoff_s": 0}, "backoff_s must be > 0 seconds"),
    ({"max_backoff_s": 0}, "max_backoff_s must be > 0 seconds"),
    ({"max_retries": -1}, "max_retries must be None or >= 0, got -1"),
    ({"stall_timeout_s": 0}, "stall_timeout_s must be > 0 seconds, got 0"),
    ({"resolve_interval_s": 0}, "resolve_interval_s must be > 0 seconds, got 0"),
    ({"stripe_batches": 0}, "stripe_batches and server_window must be >= 1, got 0 and 2"),
    ({"server_window": 0}, "stripe_batches and server_window must be >= 1, got 4 and 0"),
    ({"prefetch": 0}, "batches_per_stream must be >= 0 and prefetch >= 1, got 0 and 0"),
    ({"batches_per_stream": -1}, "batches_per_stream must be >= 0 and prefetch >= 1, got -1 and 2"),
    ({"tls_cert": b"-----BEGIN x"}, "mutual TLS needs both tls_cert and tls_key"),
    ({"tls_ca": "/nonexistent/ca.pem"}, "tls_ca: cannot read /nonexistent/ca.pem"),
    ({"max_message_bytes": 0}, "max_message_bytes must be a number of bytes > 0, got 0"),
])
def test_each_bad_option_is_refused_naming_it(kw, message):
    with pytest.raises(GdsloadError, match=message.replace("(", r"\(")):
        make(**kw)


def test_the_groups_are_frozen_and_the_retry_backoff_doubles_with_jitter():
    r = RetryPolicy(backoff_s=0.1, max_backoff_s=0.5)
    with pytest.raises(AttributeError):
        r.backoff_s = 1.0
    assert [r.backoff(n, 0.999999) for n in (1, 2, 3, 4, 9)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    assert r.backoff(3, 0.0) == pytest.approx(0.2)  # jitter takes it down to half
    assert Connection(tls_ca=b"pem").uses_tls and not Connection().uses_tls
