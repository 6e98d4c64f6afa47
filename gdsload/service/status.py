"""`gdsload.service.status`, kept for the names users and scripts import from it
(`RemoteError` first of all): the module is `gdsload.service.protocol.status`."""

from gdsload.service.protocol.status import *  # noqa: F401,F403
