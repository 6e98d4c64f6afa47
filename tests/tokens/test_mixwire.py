"""The feed's MixSpec carries a token mix's weight schedule (MixSpec.schedule, MixPhase): a
TokenLoader's mix goes over the wire and back with the same mix id; a server that mixes samples
refuses it by name."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("grpc")

import gdsload  # noqa: E402
from gdsload.plan.mix import MixSource, MixSpec  # noqa: E402


def test_the_schedule_goes_over_the_wire_and_back(corpus, tmp_path):
    from gdsload.convert.tokens import convert_corpus
    from gdsload.service.protocol import mixwire
    from gdsload.v1 import feed_pb2 as pb

    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus.docs[:30]))
    convert_corpus(str(small), str(tmp_path / "b"), tokenizer=str(corpus.tokenizer_json), workers=1)
    mix = gdsload.Mix([str(corpus.tokens), str(tmp_path / "b")], weights=[1, 1],
                      schedule=[(10_000, [1, 3]), (20_000, [0.5, 0])])
    ld = gdsload.TokenLoader(mix, 128, 2, output="numpy")
    msg = pb.MixSpec.FromString(mixwire.to_pb(mix, ld.mix).SerializeToString())
    assert mixwire.schedule_of(msg) == [(10_000, [1.0, 3.0]), (20_000, [0.5, 0.0])]
    back = MixSpec(tuple(MixSource(name=s.name, dataset_id=s.dataset_id, shard_sizes=o.shard_sizes, weight=s.weight)
                         for s, o in zip(msg.sources, ld.mix.sources)),
                   schedule=tuple((t, tuple(w)) for t, w in mixwire.schedule_of(msg)))
    assert back.mix_id == ld.mix.mix_id
    assert not pb.MixSpec.FromString(mixwire.to_pb(mix, MixSpec(ld.mix.sources)).SerializeToString()).schedule

    from gdsload.service.protocol.status import BadRequest

    req = pb.BatchRequest(mix=msg)
    with pytest.raises(BadRequest, match="weight schedule"):
        mixwire.open_mix(None, req)
