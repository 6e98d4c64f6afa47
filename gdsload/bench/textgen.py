"""Real text of mixed document lengths for token tests and benchmarks: Python's own standard
library (its `.py` sources, sorted by path, then its LICENSE.txt), each file cut at line ends into
documents whose lengths are drawn log-uniformly between 40 and 30,000 characters (a seeded
`random.Random`), until `chars` characters are taken. Nothing is generated or repeated."""

from __future__ import annotations

import math
import random
import sysconfig
from pathlib import Path


def stdlib_documents(chars: int, *, recursive: bool = False, seed: int = 51) -> list[str]:
    """Documents of the stdlib's text, `chars` characters in all (fewer if the stdlib is smaller);
    `recursive` takes the packages' sources too (a bigger corpus), else the top folder's."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.rglob("*.py") if recursive else stdlib.glob("*.py")) + [stdlib / "LICENSE.txt"]
    rng = random.Random(seed)
    docs, total = [], 0
    for f in files:
        try:
            lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
        except (OSError, UnicodeDecodeError):
            continue
        i = 0
        while i < len(lines) and total < chars:
            want = int(math.exp(rng.uniform(math.log(40), math.log(30_000))))
            doc, n = [], 0
            while i < len(lines) and n < want:
                doc.append(lines[i])
                n += len(lines[i])
                i += 1
            docs.append("".join(doc))
            total += n
        if total >= chars:
            break
    return docs
