"""A pass's media decoding: `gdsload.decode.passmedia` (there, below the pass and the feed's
server, which both decode with it); its public names re-exported."""

from gdsload.decode.passmedia import (  # noqa: F401
    INTERPOLATION,
    RATE,
    READ_AHEAD,
    NoStream,
    RangeFile,
    Window,
    _av,
    frame_windows,
    out_size,
    speech_windows,
)
