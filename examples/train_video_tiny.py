"""Train a tiny video classifier on clips decoded by gdsload (and a log-mel audio branch).

    python examples/train_video_tiny.py --shards shards/videos --steps 100

`--shards` is a dataset converted by `gdsload convert` from class folders of videos
(CLASS/VIDEO.mp4: every video probed at conversion) or KEY.mp4 + KEY.cls (+ KEY.flac) files.
`--tiny` makes one here first: 4 classes of short H.264 clips (PyAV, the `media` extra) whose
brightness pattern depends on the class, each with a FLAC track, then trains a few steps on the
CPU (what the tests run).

The loader returns, per batch, the clips under the video field ((N, C, T, H, W) float32,
normalised), the source frame indices under "mp4.frames" and, for the audio, log-mel features
under "flac" and their valid frames under "flac.length". The clip positions and crops come from
the loader's seeded plan, so `loader.state_dict()` in a checkpoint resumes with the same clips.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import gdsload


def make_tiny(root: Path, per_class: int = 6) -> Path:
    """4 classes: class c's video brightens by 12 * (c + 1) per frame (so motion decides it)."""
    from gdsload.bench import mediagen as mg
    from gdsload.convert.shards import DatasetWriter

    with DatasetWriter(root) as w:
        for c in range(4):
            for k in range(per_class):
                def pattern(i: int, h: int, w_: int, c=c) -> np.ndarray:
                    return np.full((h, w_, 3), (10 + 12 * (c + 1) * i) % 240, np.uint8)

                w.write(f"c{c}_{k}", {"mp4": mg.encode_video("h264", frames=16, width=48, height=40, pattern=pattern),
                                      "flac": mg.encode_audio("flac", seconds=0.5, sample_rate=8000, freq=200 + 200 * c),
                                      "cls": b"%d" % c})
    return root


class TinyAV(nn.Module):
    def __init__(self, classes: int, n_mels: int):
        super().__init__()
        self.video = nn.Sequential(nn.Conv3d(3, 16, 3, stride=(1, 2, 2), padding=1), nn.ReLU(),
                                   nn.Conv3d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                                   nn.AdaptiveAvgPool3d(1), nn.Flatten())
        self.audio = nn.Sequential(nn.Conv1d(n_mels, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten())
        self.head = nn.Linear(64, classes)

    def forward(self, clip: torch.Tensor, mel: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.video(clip), self.audio(mel)], 1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", help="a converted dataset with mp4, flac and cls fields")
    p.add_argument("--tiny", action="store_true", help="make a small dataset here and run a few steps")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (default: 3 epochs)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--size", type=int, default=32)
    a = p.parse_args()
    tmp = None
    if a.tiny:
        tmp = tempfile.TemporaryDirectory()
        a.shards = str(make_tiny(Path(tmp.name) / "videos"))
    if not a.shards:
        p.error("--shards or --tiny")
    n_mels = 32
    loader = gdsload.DataLoader(
        a.shards, batch_size=a.batch_size, shuffle=True, drop_last=True, num_workers=2, output="torch",
        transform={"mp4": gdsload.VideoTransform(frames=a.frames, stride=1, size=a.size),
                   "flac": gdsload.AudioTransform(sample_rate=16000, seconds=0.5, features="logmel", n_mels=n_mels)})
    model = TinyAV(4, n_mels)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step, losses = 0, []
    for epoch in range(100):
        for b in loader:
            clip, mel, y = b["mp4"], b["flac"], b["cls"]
            assert clip.shape == (a.batch_size, 3, a.frames, a.size, a.size), clip.shape
            assert b["mp4.frames"].shape == (a.batch_size, a.frames) and (b["mp4.frames"] >= 0).all()
            loss = F.cross_entropy(model(clip, mel), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
            if a.steps and step >= a.steps:
                break
        if (a.steps and step >= a.steps) or (not a.steps and epoch >= 2):
            break
    print(f"steps {step} first loss {losses[0]:.3f} last loss {losses[-1]:.3f} "
          f"(video {tuple(clip.shape)}, audio {tuple(mel.shape)})")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
