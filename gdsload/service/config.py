"""`gdsload.service.config`, kept for the names users and scripts import from it (`Limits`,
`TlsConfig`, `Keepalive`): the module is `gdsload.service.protocol.config`."""

from gdsload.service.protocol.config import *  # noqa: F401,F403
