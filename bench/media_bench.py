"""Video and audio loading: gdsload against torch DataLoader + PyAV, SPDL and torchcodec.

    python bench/media_bench.py --root /tmp/media_bench            # the real run (see bench/README)
    python bench/media_bench.py --root /tmp/mb --tiny --rounds 1   # a smoke run (tests)

Makes (once, under --root) ~300 short 360p videos, half H.264 and half VP9 (2 s at 30 fps), and
~1,000 12 s FLAC recordings, then times 16-frame 224x224 clips and 10 s log-mel features on each
set (`gdsload.bench.media`: the same clips, crops and threads for every contestant; each run a
fresh process; contestants interleaved over >= 5 rounds). Prints one table per set and, with
--json, writes every figure: clips/s per round, medians, gdsload's ratio to each contestant,
peak memory (PSS of the process tree) and decode amplification.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gdsload.bench.media import format_media, make_sets, run_media

CONTESTANTS = ["gdsload", "torch_pyav", "spdl", "torchcodec"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True, help="where the generated datasets live (made once)")
    p.add_argument("--videos", type=int, default=300)
    p.add_argument("--audios", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="per contestant (default: the cores)")
    p.add_argument("--sets", default="h264,vp9,flac")
    p.add_argument("--contestants", default=",".join(CONTESTANTS))
    p.add_argument("--tiny", action="store_true", help="4 small videos and 4 short recordings (smoke run)")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    log = lambda m: print(m, file=sys.stderr)
    if a.tiny:
        sets = make_sets(Path(a.root), videos=8, audios=4, width=320, height=240, video_frames=40,
                         audio_seconds=11.0, log=log)
        a.batch_size = min(a.batch_size, 2)
    else:
        sets = make_sets(Path(a.root), videos=a.videos, audios=a.audios, log=log)
    results = []
    for name in a.sets.split(","):
        r = run_media(str(sets[name]), contestants=a.contestants.split(","), rounds=a.rounds,
                      batch_size=a.batch_size, threads=a.threads or None, log=log)
        print(format_media(r), flush=True)
        results.append(r)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
