"""Raw tensor fields (`.npy`): no decode step, the bytes read are the tensor.

A field's dtype and shape are taken from the first sample's npy header; every sample of the
field must share them (a fixed-shape field is what a batch tensor needs). Because gdsload aligns
npy array data to 4 KiB, the extent to read for sample i is the member's payload past its header,
and it goes straight into row i of the batch buffer (device memory on a GPU host via KvikIO):
no staging copy, no parse per sample.

The batch tensor is C-ordered, so a Fortran-ordered payload would come back scrambled: such a
field is refused (`FormatError` naming shard, key and field). Conversion stores C order since
the index gained `npy_c_order`; for indexes without it, and with `verify="full"`, the loader
reads every sample's header and checks it here (`check_header`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from gdsload.errors import FormatError
from gdsload.format import npy


@dataclass(frozen=True)
class TensorField:
    """Layout of a fixed-shape `.npy` field."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    header_nbytes: int  # npy header length of the probed sample (4096 for aligned payloads)
    fortran_order: bool

    @functools.cached_property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @classmethod
    def probe(cls, name: str, head: bytes, where: str = "") -> "TensorField":
        """From the first bytes (at least the npy header) of one sample's payload; `where`
        ("shard.tar:key") names that sample in errors."""
        dtype, shape, fortran, data_off = npy.parse_header(head)
        field = cls(name, dtype, shape, data_off, fortran)
        if fortran:
            raise field._fortran_error(where)
        return field

    def _fortran_error(self, where: str) -> FormatError:
        return FormatError(
            f"{where}: field {self.name!r} is stored in Fortran order, which a C-ordered batch "
            f"tensor would return scrambled; the dataset was converted by an older gdsload: "
            f"re-run gdsload convert (it stores C order)"
        )

    def check_header(self, where: str, head: bytes | memoryview) -> int:
        """Parse one sample's npy header, check it against the field (dtype, shape, C order);
        returns its array-data offset."""
        dtype, shape, fortran, off = npy.parse_header(head)
        if dtype != self.dtype or shape != self.shape:
            raise FormatError(
                f"sample {where!r}: field {self.name!r} is {dtype}{list(shape)}, the field's first "
                f"sample is {self.dtype}{list(self.shape)}; a batch needs one shape per field"
            )
        if fortran:
            raise self._fortran_error(where)
        return off

    def data_extent(self, key: str, payload_offset: int, payload_nbytes: int, head: bytes | None = None) -> tuple[int, int]:
        """(file offset, nbytes) of a sample's array data; checks it matches the probed layout.

        Aligned payloads (>= 4 KiB) always have a 4096-byte header, so the size check suffices;
        small ones may have headers of other lengths, so their header bytes `head` are parsed.
        """
        off = self.header_nbytes if head is None else self.check_header(key, head)
        if payload_nbytes - off != self.nbytes:
            raise FormatError(
                f"sample {key!r}: field {self.name!r} holds {payload_nbytes - off} bytes of array data, "
                f"expected {self.nbytes} ({self.dtype}{list(self.shape)}); a batch needs one shape per field"
            )
        return payload_offset + off, self.nbytes
