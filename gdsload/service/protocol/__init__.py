"""What both ends of the feed agree on: the messages' contents and limits, shared by the client
(`gdsload.service.client`) and the server (`gdsload.service.server`); nothing here imports either.

| module | one line |
| --- | --- |
| `request.py` | a loader's options <-> `BatchRequest` (`to_request`, `to_options`), checked in one place |
| `wire.py` | a batch <-> `BatchChunk` messages under the message limit (`ChunkAssembler` on the client) |
| `imagewire.py` | an `ImageTransform` <-> `ImageTransformSpec` |
| `mediawire.py` | video/audio transforms <-> specs, within the server's media limits |
| `framing.py` | the bulk connection: ticket, frame, end marker and their constants |
| `mixwire.py` | a `Mix` <-> `BatchRequest.mix` |
| `status.py` | exceptions <-> gRPC status codes (the one mapping), retryable codes |
| `auth.py` | bearer-token server interceptor, client metadata |
| `config.py` | `ServerConfig`, limits, keepalive, TLS; the gRPC options both ends set |

Reading order for one batch: `request.to_request` (client) -> `request.to_options` (server) ->
`wire.encode_frames` (server) -> `framing` (bulk) -> `wire.split_chunk` / `wire.ChunkAssembler` (client).
"""
