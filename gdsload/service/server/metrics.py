"""Prometheus metrics of a feed server, in a registry of its own (several servers may share a
process, as in the tests), exposed over HTTP on `--metrics-port`.

| metric                                  | type      | labels            |
| --------------------------------------- | --------- | ----------------- |
| gdsload_feed_batches_total              | counter   | dataset, payload  |
| gdsload_feed_samples_total              | counter   | dataset, payload  |
| gdsload_feed_bytes_total (batch bodies) | counter   | dataset, payload  |
| gdsload_feed_streams_total              | counter   | dataset           |
| gdsload_feed_consumers (open streams)   | gauge     | dataset           |
| gdsload_feed_errors_total               | counter   | code              |
| gdsload_feed_read_seconds               | histogram | payload           |
| gdsload_feed_send_seconds               | histogram | payload           |
| gdsload_feed_decode_pool_busy           | gauge     |                   |
| gdsload_feed_decode_pool_streams        | gauge     |                   |
| gdsload_feed_decode_queue_seconds       | histogram | dataset           |
| gdsload_feed_share_subscribers          | gauge     | dataset           |
| gdsload_feed_share_subscriptions_total  | counter   | dataset           |
| gdsload_feed_share_producers            | gauge     |                   |
| gdsload_feed_share_produced_total       | counter   | dataset           |
| gdsload_feed_share_sent_total           | counter   | dataset           |
| gdsload_feed_share_fallbacks_total      | counter   | dataset, reason   |
| gdsload_feed_share_window_bytes         | gauge     |                   |
| gdsload_feed_bulk_streams_total         | counter   |                   |
| gdsload_feed_stored_streams_total       | counter   |                   |
| gdsload_feed_priority_queue             | gauge     | priority          |
| gdsload_feed_priority_paused            | gauge     | priority          |
| gdsload_feed_priority_batches_total     | counter   | priority          |
| gdsload_feed_priority_paused_seconds_total | counter | priority         |

read: time a stream waited for its next batch from the loader (read + decode, after prefetch).
send: time from handing a batch's first chunk to gRPC until gRPC asked for the next batch
(serialization and flow control: a slow consumer shows up here).
decode pool (`gdsload.service.server.pool`): workers decoding now (occupancy), decoding streams attached,
and the time each batch waited in the pool's queue for a worker.
share groups (`gdsload.service.server.share`, BatchRequest.share): subscribers (streams of a share group)
attached now and started in all; producers running (each reads and decodes once for its
subscribers); batches produced (read and decoded once) and sent (to each subscriber: sent /
produced is how many times a batch was used); fallbacks: subscribers given a producer of their
own because they arrived behind every producer's window (`behind`) or held a full window up too
long (`detached`); bytes of serialized batches held in the windows now.
priorities (`gdsload.service.server.priority`, BatchRequest.priority; a share group's streams at
their highest member's): streams waiting for their turn to make a batch now (paused ones
included), streams paused now for a higher level's work, batches made, and seconds streams spent
paused (summed over streams).
bulk streams: streams whose client took the side connection (`gdsload.service.server.bulk`); the others
went inside gRPC.
"""

from __future__ import annotations

from gdsload.errors import require


class Metrics:
    def __init__(self) -> None:
        prom = require("prometheus_client", extra="serve", purpose="the feed server's metrics")
        self.registry = prom.CollectorRegistry()
        r = self.registry
        buckets = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
        self.batches = prom.Counter("gdsload_feed_batches", "Batches sent", ["dataset", "payload"], registry=r)
        self.samples = prom.Counter("gdsload_feed_samples", "Samples sent", ["dataset", "payload"], registry=r)
        self.bytes = prom.Counter("gdsload_feed_bytes", "Batch body bytes sent", ["dataset", "payload"], registry=r)
        self.streams = prom.Counter("gdsload_feed_streams", "StreamBatches calls started", ["dataset"], registry=r)
        self.consumers = prom.Gauge("gdsload_feed_consumers", "StreamBatches calls in progress", ["dataset"], registry=r)
        self.errors = prom.Counter("gdsload_feed_errors", "Calls ended with an error status", ["code"], registry=r)
        self.read_s = prom.Histogram("gdsload_feed_read_seconds", "Wait for the next batch from the loader",
                                     ["payload"], buckets=buckets, registry=r)
        self.send_s = prom.Histogram("gdsload_feed_send_seconds", "Time to hand one batch's chunks to gRPC",
                                     ["payload"], buckets=buckets, registry=r)
        self.pool_busy = prom.Gauge("gdsload_feed_decode_pool_busy", "Decode pool workers decoding now", registry=r)
        self.pool_streams = prom.Gauge("gdsload_feed_decode_pool_streams", "Streams decoding through the pool",
                                       registry=r)
        self.queue_s = prom.Histogram("gdsload_feed_decode_queue_seconds", "Wait of a batch for a decode pool worker",
                                      ["dataset"], buckets=buckets, registry=r)
        self.share_subscribers = prom.Gauge("gdsload_feed_share_subscribers", "Streams attached to a share group",
                                            ["dataset"], registry=r)
        self.share_subscriptions = prom.Counter("gdsload_feed_share_subscriptions", "Streams of a share group started",
                                                ["dataset"], registry=r)
        self.share_producers = prom.Gauge("gdsload_feed_share_producers", "Share group producers running", registry=r)
        self.share_produced = prom.Counter("gdsload_feed_share_produced", "Batches read and decoded by share producers",
                                           ["dataset"], registry=r)
        self.share_sent = prom.Counter("gdsload_feed_share_sent", "Batches sent to share group subscribers",
                                       ["dataset"], registry=r)
        self.share_fallbacks = prom.Counter("gdsload_feed_share_fallbacks",
                                            "Subscribers given a producer of their own (behind, detached)",
                                            ["dataset", "reason"], registry=r)
        self.share_window_bytes = prom.Gauge("gdsload_feed_share_window_bytes",
                                             "Bytes of serialized batches in share windows", registry=r)
        self.bulk_streams = prom.Counter("gdsload_feed_bulk_streams",
                                         "Streams sent on a bulk connection (BatchRequest.bulk)", registry=r)
        self.stored_streams = prom.Counter("gdsload_feed_stored_streams",
                                           "Raw streams sent as stored, from the page cache "
                                           "(gdsload.service.server.stored)", registry=r)
        self.priority_queue = prom.Gauge("gdsload_feed_priority_queue",
                                         "Streams waiting for their turn to make a batch (paused ones included)",
                                         ["priority"], registry=r)
        self.priority_paused = prom.Gauge("gdsload_feed_priority_paused",
                                          "Streams paused for a higher priority's work", ["priority"], registry=r)
        self.priority_batches = prom.Counter("gdsload_feed_priority_batches", "Batches made, per priority level",
                                             ["priority"], registry=r)
        self.priority_paused_s = prom.Counter("gdsload_feed_priority_paused_seconds",
                                              "Seconds streams spent paused, summed over streams", ["priority"],
                                              registry=r)
        self._http = None
        self.address: tuple[str, int] | None = None

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Start the HTTP exporter (a daemon thread); returns the bound port (`port` 0: any)."""
        prom = require("prometheus_client", extra="serve", purpose="the feed server's metrics")
        self._http, _ = prom.start_http_server(port, addr=addr, registry=self.registry)
        self.address = self._http.server_address[:2]  # (host, port) as bound
        return self._http.server_port

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def text(self) -> str:
        prom = require("prometheus_client", extra="serve", purpose="the feed server's metrics")
        return prom.generate_latest(self.registry).decode()
