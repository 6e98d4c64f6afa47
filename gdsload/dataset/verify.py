"""What the loader checks while it reads: `Dataset(path, verify="fast" | "full" | None)`.

`gdsload verify` reads and hashes everything; the loader cannot afford that per epoch, so it
checks what is cheap where it already has the bytes. Checked whatever `verify` says:

- index arrays against each other, and every member's extent against its shard's size (an index
  that would make the loader read or allocate outside a shard is a `FormatError` naming it);
- labels: copied from the index's int64 column, validated at conversion (older indexes without
  the column: each `.cls` is parsed with the same rules, a bad one is a `FormatError` naming
  shard and key, never -1 or a bare `ValueError`);
- `.npy` fields: dtype, shape and C order of the first sample, the size of every sample; with an
  index from before conversion guaranteed C order (`npy_c_order`), each sample's header too
  (4 KiB more read per sample), so a Fortran-ordered payload is refused, never returned scrambled.

`verify="fast"` (the default) adds, for a CRC32 pass over the encoded bytes (`gdsload.format.crc`:
ISA-L's, ~50 GB/s per core on a 2-core VM, small next to reading them) and nothing for a tensor
dataset:

- each shard file's size against the manifest, once when the loader starts (one `stat` per
  shard, one listing of the dataset folder at a URL);
- the CRC32 of every member the loader stages in host memory
  (encoded images, text and other bytes, labels of older indexes) against the CRC stored at
  conversion.

`verify="full"` adds the CRC32 of `.npy` tensors (read straight into the batch, so their 4 KiB
headers are read too, and on a device ring the tensor rows are copied back to the host for the
check: for audits, not for training speed). `verify=None` turns off the optional checks.

Not checked by the loader: bytes it does not read (other fields, tar headers, padding, the DALI
index) and the shard's SHA-256; a payload changed on disk is found by `fast` only where its CRC is
checked (`.npy` tensors need `full`). Indexes written before CRCs were stored: `fast` checks shard
sizes only for them and says so once (a `UserWarning`, and `stats()["verify"]`); `full` refuses
the dataset. A CRC mismatch is a `FormatError` naming shard, key and field, whatever `on_error`
says: it means the file changed after conversion, not that a sample was bad to begin with
(`CorruptDataError`, a `FormatError`: a feed server answers DATA_LOSS, and clients try their other
addresses). A shard file that is missing is a `StorageError` (transient).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, Optional

from gdsload.errors import CorruptDataError, FormatError, GdsloadError, StorageError
import numpy as np

from gdsload.format.crc import crc32, first_mismatch
from gdsload.format.labels import parse_label
from gdsload.dataset.sharded import ShardedDataset

VerifyMode = Optional[Literal["fast", "full"]]
VERIFY_MODES = (None, "fast", "full")


def check_mode(verify: Any) -> VerifyMode:
    if verify not in VERIFY_MODES:
        raise GdsloadError(f"verify must be 'fast', 'full' or None, not {verify!r}")
    return verify


def check_dataset(ds: ShardedDataset, mode: VerifyMode) -> str:
    """Start-of-loading checks for `mode` over every shard; returns what will be checked per
    batch, for `stats()["verify"]`. Indexes are loaded (and their extents checked) here only for
    shards whose manifest entry does not say they hold CRC32s (older conversions); the others
    are checked the same way when a batch first reads them."""
    if mode is None:
        return "off"
    for s, (entry, size) in enumerate(zip(ds.shards, ds.stored_sizes())):
        if size != entry["bytes"]:  # missing: maybe a storage fault; another size: a changed copy
            raise (StorageError if size is None else CorruptDataError)(
                f"{ds.shard_path(s)}: {'missing' if size is None else f'{size} bytes'}, the manifest says "
                f"{entry['bytes']}: the shard changed after conversion; run gdsload verify {ds.root}"
            )
    old = [ds.shard_path(s, "index") for s, entry in enumerate(ds.shards)
           if not entry.get("member_crc") and ds.index(s).member_crc is None]
    indexes = ds.shards
    if not old:
        return mode
    if mode == "full":
        raise FormatError(
            f"verify='full' needs the CRC32s that gdsload convert stores in each index, and "
            f"{len(old)} of {len(indexes)} indexes have none (first: {old[0]}); re-run "
            f"gdsload convert, or check with gdsload verify {ds.root}"
        )
    note = f"fast, shard sizes only for {len(old)} of {len(indexes)} shards (their indexes hold no CRC32s)"
    warnings.warn(f"{ds.root}: verify='fast' checks {note[6:]}; re-run gdsload convert to get them",
                  UserWarning, stacklevel=2)
    return note


def _mismatch(where: str, field: str, got: int, expected: int, more: str = "") -> CorruptDataError:
    """The one error for a member whose bytes differ from what was converted."""
    return CorruptDataError(
        f"{where}: field {field!r} differs from what was converted (CRC32 {got:08x}, the index says "
        f"{expected:08x}): the shard changed on disk; run gdsload verify{more}"
    )


def check_crcs(reads: Any, staging: Any, rows: Any = None) -> None:
    """Every check of a planned batch (`gdsload.loader.gather.BatchReads`) once its bytes have
    landed: the one checker of the loader.

    1. `.npy` headers staged (`reads.tensor_checks`: `verify="full"`, indexes without
       `npy_c_order`) parsed against their field: dtype, shape, C order (`TensorField.check_header`).
    2. The CRC32 of every staged member against the index (`gdsload.format.crc.first_mismatch`):
       members that follow each other in `staging` with no byte between them (the dense layout
       of `plan(..., packed=True)`) are checked as one run, in one `crc32` call.
    3. Under `verify="full"`, the CRC32 of every `.npy` member: its staged header, then its row of
       the batch tensor; `rows[field]` is (flat array, offset of row 0) of that tensor, NumPy or,
       on a device ring, CuPy (each row copied to the host for the check).
    """
    names = reads.names
    for tc in reads.tensor_checks:
        hpos, hnb, hsmp = tc.heads
        for a, n, i in zip(hpos.tolist(), hnb.tolist(), hsmp.tolist()):
            tc.tensor.check_header(names[i], memoryview(staging[a : a + n]))
    if reads.crc is not None:
        _check_staged(reads, staging)
    for tc in reads.tensor_checks:
        if not tc.crcs:
            continue
        flat, base = rows[tc.name]
        nb = tc.tensor.nbytes
        for i, expected, head in tc.crcs:
            if isinstance(head, bytes):  # a payload under 4 KiB, read whole while planning
                crc = crc32(head)
            else:
                a, n = head
                start = base + i * nb
                crc = crc32(_host(flat[start : start + nb]), crc32(memoryview(staging[a : a + n])))
            if crc != expected:
                raise _mismatch(names[i], tc.name, crc, expected)


def _check_staged(reads: Any, staging: Any) -> None:
    """Step 2 of `check_crcs`: the staged members' CRC32s, by runs (`first_mismatch`)."""
    pos, nb, expected, smp, fields = reads.crc
    bad = first_mismatch(memoryview(staging), pos, nb, expected)
    if bad is not None:
        k, got, count = bad
        raise _mismatch(reads.names[int(smp[k])], fields[k], got, int(expected[k]),
                        f" ({count} such members in this batch)")


def label(buf: Any, start: int, nbytes: int, where: str, field: str) -> int:
    """A label member staged at `buf[start:start + nbytes]` (indexes without a label column)."""
    try:
        return parse_label(memoryview(buf[start : start + nbytes]))
    except FormatError as exc:
        raise FormatError(f"{where}: field {field!r}: {exc}") from None


def _host(view: Any) -> Any:
    """A buffer `crc32` can read: host arrays as they are, device (CuPy) arrays copied to the host."""
    return view.get() if hasattr(view, "__cuda_array_interface__") else view
