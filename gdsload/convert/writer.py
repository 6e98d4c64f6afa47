"""The public dataset writer: `gdsload.ShardWriter` (samples in, a whole dataset out) and
`gdsload.write(fn, inputs, dst, workers=N)` (a user function over inputs, in worker processes).

One writer for every way data comes in (`convert`'s columnar inputs and appends use it too), with
the guarantees of `gdsload convert`: aligned payloads, the index with CRCs and label columns, the
DALI index, shards published whole, the manifest last, one writer per destination (`Store.lock`),
crash-safe resume, rejects with reasons in `rejected.jsonl`.

Samples are dicts: `"__key__"` (a str, unique in the dataset) and fields named by extension
(`jpg`, `cls`, `caption.txt`, `emb.npy`): the extension says how a field is stored and decoded, so
a name without one (`image`, `label`) is refused naming the `NAME.EXT` form (`.bin` for raw
bytes). A dataset's fields are its first sample's: every later sample has exactly those (no
optional fields: a loader reads the fields it is given from every sample), and one with a field
missing or extra is refused naming the sample and the field (`write`: an error, as a key
collision is, not a reject). Values: bytes as they are; str as UTF-8; an int as a decimal label (`.cls`); a NumPy
array (or a list of numbers for a `.npy` field) as a `.npy` (`gdsload.format.npy.encode_stored`:
array data 4 KiB-aligned from 4 KiB up, a small array packed with NumPy's own header); dicts, lists, floats, bools
and None as JSON. Other keys starting with `__` are ignored;
in `write`, a sample `{"__key__": k, "__reject__": "why"}` is left out and recorded as a reject.

Order and determinism: samples are written in the order given (`write`: input order, then the
order `fn` yields them), and shards are cut over that order when the next sample would take the
shard past `shard_size` (estimated as `convert` plans: headers plus mean padding), so the output
bytes do not depend on the number of workers. Keys must be unique over the whole dataset, appends
included: a collision is an error naming both places.

Resume (`resume=True`): shards finished by an interrupted writer are kept (each leaves a record in
`DST/.gdsload-convert/done/`); the same samples are fed again and the writer skips those already
written, checking their keys come in the same order. `write` records where each shard ended
(input number, sample within it) and does not call `fn` again for inputs already written.

Appends (`append=True`): new shards are added after the existing ones (never rewritten) and the
manifest gets a new version, written last, so a reader of the old manifest keeps reading the old
version. Appended samples must have exactly the dataset's fields, `.npy` fields with the same
dtype (and the same shape where the dataset's is fixed). Class names (`classes=`) are merged: new
names go at the end, and `.cls` labels are renumbered into the merged list. An append to an
fsspec URL is refused: no lock can be taken there (`gdsload.io.store`). A data error during an
append (a key collision, a field that differs) removes the append's shards: nothing changes.

Memory: one shard's index entries, the set of keys, and (for `write`) at most `QUEUE_CHUNKS`
chunks of `CHUNK_NBYTES` per worker in flight. Workers are processes (payloads pickled to the
writer) or, with `executor="thread"`, threads (payloads passed as they are, memoryviews too).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from gdsload.convert.engine import (
    PLAN,
    REJECTED,
    STATE_DIR,
    _clean,
    _ours,
    refuse_foreign,
    validate_image,
)
from gdsload.convert.shards import ShardFile, make_manifest, shard_name
from gdsload.errors import DestinationError, FormatError, GdsloadError, InputError
from gdsload.format import manifest as mf
from gdsload.format import npy
from gdsload.format.index import ShardIndex, check_key
from gdsload.format.labels import parse_label
from gdsload.format.tar import ALIGN, BLOCK
from gdsload.io import is_remote
from gdsload.io.store import (
    LOCK,
    load_manifest,
    open_store,
    save_manifest,
)
from gdsload.sizes import parse_size

Payloads = dict[str, bytes]


# -- samples -------------------------------------------------------------------------------------
def encode_value(key: str, ext: str, value: Any) -> bytes | memoryview:
    """The bytes a sample value is stored as (rules in the module docstring)."""
    kind = mf.field_kind(ext)
    if isinstance(value, (bytes, memoryview)):
        return value
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    if kind == "tensor" and isinstance(value, (np.ndarray, np.generic, list, tuple)):
        arr = np.asarray(value)
        if arr.dtype.hasobject:
            raise FormatError(f"sample {key!r}: field {ext!r}: a ragged or mixed list cannot be an array")
        return npy.encode_stored(arr)
    if isinstance(value, (np.ndarray, np.generic)) and not isinstance(value, np.integer):
        raise FormatError(f"sample {key!r}: field {ext!r} holds a NumPy array: name the field NAME.npy "
                          f"(or npy) to store it as a tensor")
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return str(int(value)).encode()
    if isinstance(value, (dict, list, tuple, float, bool)) or value is None:
        if kind == "label":
            raise FormatError(f"sample {key!r}: label field {ext!r} must be an int, got {type(value).__name__}")
        try:
            return json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise FormatError(f"sample {key!r}: field {ext!r} cannot be stored as JSON: {exc}") from None
    raise FormatError(f"sample {key!r}: field {ext!r} has a value of type {type(value).__name__}; "
                      f"use bytes, str, int, a NumPy array, or a dict/list (JSON)")


def encode_sample(sample: Mapping[str, Any]) -> tuple[str, Payloads]:
    """`(key, {ext: bytes})` of a sample dict."""
    if not isinstance(sample, Mapping):
        raise FormatError(f"a sample must be a dict with '__key__' and fields, got {type(sample).__name__}")
    key = sample.get("__key__")
    if not isinstance(key, str):
        raise FormatError(f"a sample needs '__key__' (a str), got {key!r} (fields: {sorted(sample)[:5]})")
    check_key(key)
    out = {ext: encode_value(key, ext, v) for ext, v in sample.items() if not ext.startswith("__")}
    if not out:
        raise FormatError(f"sample {key!r} has no fields")
    return key, out  # type: ignore[return-value]


def has_extension(name: str) -> bool:
    """Whether a field name says how the field is stored: `NAME.EXT`, or a known extension alone
    (`jpg`, `cls`, `txt`, `npy`, `json`, `bin`, `mp4`, `wav`, ...)."""
    base, dot, ext = name.rpartition(".")
    if dot:
        return bool(base and ext)
    return mf.field_kind(name) != "bytes" or name.lower() == "bin"


def _check_names(key: str, payloads: Mapping[str, Any], where: str) -> None:
    """The first sample's field names (the dataset's) each have an extension."""
    bare = [name for name in payloads if not has_extension(name)]
    if bare:
        named = "" if where == f"sample {key!r}" else f" ({where})"
        raise InputError(
            f"sample {key!r}{named}: field{'s' if len(bare) > 1 else ''} {', '.join(map(repr, bare))} "
            f"{'have' if len(bare) > 1 else 'has'} no extension; name a field NAME.EXT (e.g. "
            f"'{bare[0]}.jpg', '{bare[0]}.cls', '{bare[0]}.txt', '{bare[0]}.npy', or '{bare[0]}.bin' for raw bytes) "
            f"or by its extension alone ('jpg', 'cls'): the extension says how it is stored and decoded")


def sample_nbytes(payloads: Mapping[str, bytes | memoryview]) -> int:
    """Bytes a sample takes in a shard, estimated as `convert` plans (headers, mean padding)."""
    total = 0
    for p in payloads.values():
        n = len(p)
        total += BLOCK + -(-n // BLOCK) * BLOCK + (BLOCK + ALIGN // 2 if n >= ALIGN else 0)
    return total


def _npy_spec(payload: bytes | memoryview) -> tuple[str, tuple[int, ...]]:
    dtype, shape, _, _ = npy.parse_header(payload)
    return dtype.str, tuple(shape)


# -- the writer ----------------------------------------------------------------------------------
class ShardWriter:
    """Write a whole gdsload dataset at `dst` (a local folder or fsspec URL), sample by sample.

    ```
    with gdsload.ShardWriter("shards/train", shard_size="512MB", classes=["cat", "dog"]) as w:
        for i, (jpeg, label) in enumerate(data):
            w.write({"__key__": f"{i:08d}", "jpg": jpeg, "cls": label})
    ```

    `close()` (leaving `with`) writes the manifest and returns it; an exception inside `with`
    leaves no dataset that looks complete (module docstring: resume, appends). `overwrite=True`
    replaces a gdsload dataset at `dst`. `validate=True` decodes every image (Pillow) and refuses
    one that the loader's decoder could not decode. Not thread-safe: one writer, one thread.
    """

    def __init__(self, dst: str | os.PathLike[str], shard_size: int | str = "1GiB", *, prefix: str = "shard",
                 classes: Sequence[str] | None = None, append: bool = False, resume: bool = False,
                 overwrite: bool = False, validate: bool = False, source_format: str = "api",
                 created: Mapping[str, Any] | None = None, fingerprint: str = ""):
        self.shard_size = parse_size(shard_size) if isinstance(shard_size, str) else int(shard_size)
        if self.shard_size < 4 * ALIGN:
            raise InputError(f"shard_size {shard_size!r} is too small (minimum {4 * ALIGN} bytes)")
        if append and overwrite:
            raise InputError("append=True and overwrite=True contradict each other: choose one")
        self.store = open_store(str(dst))
        self.prefix, self.validate, self.append = prefix, validate, append
        self._created = {"source_format": source_format, **(created or {})}
        self._user_classes = list(classes) if classes is not None else None
        self.fingerprint = hashlib.sha256(json.dumps(
            [self.shard_size, prefix, self._user_classes, validate, append, fingerprint]).encode()).hexdigest()
        self.shards: list[mf.ShardEntry] = []  # of this writer's version, kept ones first
        self.fields: dict[str, str] = {}
        self.rejects: list[dict[str, Any]] = []
        self._keys: dict[str, str] = {}  # key -> where it was written (for collision messages)
        self._skip: list[str] = []  # resume: keys of kept shards, in order, not yet seen again
        self._skip_at = 0
        self._cur: ShardFile | None = None
        self._cur_nbytes = 0
        self._cur_rejects: list[dict[str, Any]] = []
        self._cur_fields: dict[str, str] = {}
        self.resume_point: tuple[int, int] | None = None  # (input, sample) where kept shards end
        self._origin: tuple[int, int] | None = None  # of the sample being written (`write`)
        self._new: list[str] = []  # shard names this writer wrote (removed again on a data error)
        self._bad_data = False
        self._closed = False
        self.manifest: dict[str, Any] | None = None  # set once complete
        self._base: dict[str, Any] | None = None  # the manifest appended to
        self._label_map: dict[int, int] | None = None
        self._npy: dict[str, tuple[str, tuple[int, ...] | None]] = {}  # append: dtype, fixed shape
        # Finished shards are published (fsynced, renamed, recorded) on one thread, in order,
        # while the next shard is written: an fsync waits for the disk, ~0.1 s per 256 MB here.
        self._publisher: Any = None
        self._publishing: list[Any] = []  # futures, oldest first
        self._publish_failed = False
        self._stack = contextlib.ExitStack()
        try:
            self._open(resume, overwrite)
        except BaseException:
            self._stack.close()
            raise

    # -- opening -------------------------------------------------------------------------------
    def _open(self, resume: bool, overwrite: bool) -> None:
        store = self.store
        if store.is_file():
            raise DestinationError(f"{store.root}: exists and is not a folder")
        if self.append and is_remote(store.root):
            raise DestinationError(
                f"{store.root}: appending to a dataset at a URL is refused: no lock can be taken there, "
                f"so a second writer would go unnoticed; append to a local copy, or write a new dataset "
                f"and combine them with gdsload.Mix")
        if self.append and not store.exists(mf.MANIFEST):
            hint = " (an interrupted conversion is there: resume it first)" if store.exists(STATE_DIR) else ""
            raise DestinationError(f"{store.root}: no dataset to append to{hint}")
        store.make_dirs()
        self._stack.enter_context(store.lock())
        if self.append:
            self._open_append(resume)
        else:
            self._open_fresh(resume, overwrite)
        self.classes = self._merged_classes()

    def _open_fresh(self, resume: bool, overwrite: bool) -> None:
        store = self.store
        entries = [n for n in store.list() if n != LOCK]
        has_manifest, has_state = mf.MANIFEST in entries, STATE_DIR in entries
        if has_manifest and resume and not overwrite:
            m = load_manifest(store)
            if (m.get("created") or {}).get("fingerprint") == self.fingerprint:
                self.manifest = m  # this very run finished already: nothing to do
                return
        refuse_foreign(store.root, entries)
        if has_manifest and not overwrite:
            raise DestinationError(f"{store.root} already holds a dataset ({mf.MANIFEST} exists); pass "
                                   f"overwrite=True to replace it or append=True to add to it")
        if has_state and not (resume or overwrite):
            raise DestinationError(f"{store.root} holds an interrupted conversion; pass resume=True to "
                                   f"continue it or overwrite=True to start over")
        if has_state and resume and not has_manifest and self._resume_state():
            return
        if entries:
            _clean(store)
        self._start_state()

    def _open_append(self, resume: bool) -> None:
        store = self.store
        self._base = load_manifest(store)
        base = self._base
        if mf.versions(base)[-1].get("fingerprint") == self.fingerprint and resume:
            self.manifest = base  # the last version is this very append, finished
            return
        self.fields = dict(base["fields"])
        listed = {n for s in base["shards"] for n in (s["name"], s["index"], s["dali_index"])}
        if store.exists(STATE_DIR) and not (resume and self._resume_state()):
            # an earlier append that was interrupted (no reader sees its shards): drop it
            for name in store.list():
                if name not in listed and name != mf.MANIFEST and _ours(name) and name != REJECTED:
                    if name == STATE_DIR:
                        store.remove_tree(name)
                    else:
                        store.remove(name)
        if not store.exists(f"{STATE_DIR}/{PLAN}"):
            self._start_state()
        for s in base["shards"]:
            for k in ShardIndex.from_bytes(store.read(s["index"]), name=store.where(s["index"])).keys():
                self._keys[k] = f"shard {s['name']} of the dataset"
        self._npy = self._npy_specs(base)

    def _npy_specs(self, base: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...] | None]]:
        """Per `.npy` field of the dataset: its dtype, and its shape where every payload has one
        size (then the shape is fixed); read from the first sample's header (a local dataset)."""
        specs: dict[str, tuple[str, tuple[int, ...] | None]] = {}
        fields = [f for f, kind in base["fields"].items() if kind == "tensor"]
        if not fields or not base["shards"]:
            return specs
        first = base["shards"][0]
        idx = ShardIndex.from_bytes(self.store.read(first["index"]))
        members = {ext: (off, n) for ext, off, n in idx.members(0)}
        path = os.path.join(self.store.root, first["name"])
        with open(path, "rb") as f:
            for ext in fields:
                if ext not in members:
                    continue
                off, n = members[ext]
                f.seek(off)
                dtype, shape = _npy_spec(f.read(min(n, 1 << 20)))
                sizes = {(s.get("min_nbytes", {}).get(ext), s.get("max_nbytes", {}).get(ext))
                         for s in base["shards"]}
                fixed = len(sizes) == 1 and None not in next(iter(sizes)) and len(set(next(iter(sizes)))) == 1
                specs[ext] = (dtype, shape if fixed else None)
        return specs

    def _start_state(self) -> None:
        self.store.make_dirs(f"{STATE_DIR}/done")
        self.store.write(f"{STATE_DIR}/{PLAN}", json.dumps({"fingerprint": self.fingerprint, "kind": "writer"}).encode())

    def _resume_state(self) -> bool:
        """Keep the shards an interrupted run of this same writer finished; False when the state
        is another run's (then it is dropped, or refused by the caller)."""
        store = self.store
        try:
            plan = json.loads(store.read(f"{STATE_DIR}/{PLAN}"))
        except (OSError, json.JSONDecodeError):
            return False
        if plan.get("fingerprint") != self.fingerprint:
            if self.append:
                return False
            raise DestinationError(
                f"{store.root}: the interrupted conversion used other options or inputs; re-run it with the "
                f"same ones, or pass overwrite=True to start over")
        for name in store.list():
            if name.startswith(".") and ".tmp-" in name:
                store.remove(name)
        first = len(self._base["shards"]) if self._base else 0
        i = 0
        while True:
            name = shard_name(self.prefix, first + i)
            rec_name = f"{STATE_DIR}/done/{name}.json"
            if not store.exists(rec_name):
                break
            rec = json.loads(store.read(rec_name))
            entry = rec["entry"]
            if store.size(entry["name"]) != entry["bytes"] or store.size(entry["index"]) is None:
                break
            self.shards.append(entry)
            self._new.append(name)
            self.fields.update(rec["fields"])
            self.rejects += rec["rejects"]
            if rec.get("classes") is not None:
                self._user_classes = rec["classes"]
            self.resume_point = tuple(rec["next"]) if rec.get("next") else None
            keys = ShardIndex.from_bytes(store.read(entry["index"])).keys()
            for k in keys:
                self._keys[k] = f"shard {entry['name']}"
            self._skip += keys
            i += 1
        for rec in store.list(f"{STATE_DIR}/done"):  # records after a gap are redone
            if rec.endswith(".json") and rec[:-5] not in self._new:
                store.remove(f"{STATE_DIR}/done/{rec}")
        return True

    def _merged_classes(self) -> list[str] | None:
        """The manifest's class list, and on an append the renumbering of this writer's labels."""
        mine = self._user_classes
        if self._base is None:
            return mine
        old = self._base.get("classes")
        if mine is None:
            return old
        merged = list(old or [])
        merged += [c for c in mine if c not in merged]
        self._label_map = {i: merged.index(c) for i, c in enumerate(mine)}
        if all(a == b for a, b in self._label_map.items()):
            self._label_map = None
        return merged

    # -- writing -------------------------------------------------------------------------------
    @property
    def complete(self) -> bool:
        """True where `resume=True` found this very run already finished (writes are ignored)."""
        return self.manifest is not None and not self._closed

    def write(self, sample: Mapping[str, Any]) -> None:
        """Add one sample (a dict: `"__key__"` and fields; module docstring)."""
        try:
            key, payloads = encode_sample(sample)
        except GdsloadError:
            self._bad_data = True
            raise
        self.add(key, payloads)

    def add(self, key: str, payloads: Mapping[str, bytes | memoryview], *, where: str | None = None,
            reject: bool = False) -> bool:
        """Add a sample given as `{ext: bytes}`; `where` names its origin in messages. With
        `reject`, a sample the format refuses (a bad label or `.npy`, an image that does not
        decode with `validate`) is recorded in `rejected.jsonl` instead of raised. Returns whether
        the sample was written (or skipped as already written by a resumed run)."""
        if self._closed:
            raise GdsloadError("this ShardWriter is closed")
        if self.manifest is not None:
            return True
        if self._skip_at < len(self._skip):
            want = self._skip[self._skip_at]
            if key != want:
                raise DestinationError(
                    f"resume: sample {self._skip_at} has key {key!r}, the interrupted run wrote {want!r} there: "
                    f"the samples do not come in the same order (the input must be fed again exactly)")
            self._skip_at += 1
            return True
        try:
            return self._add(key, payloads, where or f"sample {key!r}", reject)
        except GdsloadError:
            self._bad_data = True
            raise

    def _add(self, key: str, payloads: Mapping[str, bytes | memoryview], where: str, reject: bool) -> bool:
        other = self._keys.get(key)
        if other is not None:
            raise InputError(f"duplicate sample key {key!r}: {other} and {where}")
        want = self.fields or self._cur_fields  # the dataset's fields: its first sample's (or the base's)
        if not want:
            _check_names(key, payloads, where)
        elif payloads.keys() != want.keys():
            self._fields_differ(key, payloads, want, where)
        if self._npy:
            self._check_npy(key, payloads)
        try:
            if self.validate:
                for ext, data in payloads.items():
                    if mf.field_kind(ext) == "image":
                        validate_image(bytes(data))
            if self._label_map is not None and "cls" in payloads:
                payloads = dict(payloads)
                label = parse_label(payloads["cls"])
                payloads["cls"] = str(self._label_map.get(label, label)).encode()
            n = sample_nbytes(payloads)
            if self._cur is not None and self._cur.num_samples and self._cur_nbytes + n > self.shard_size:
                self._finish_shard()
            if self._cur is None:
                name = shard_name(self.prefix, self._first_index() + len(self.shards))
                if self._base is not None and any(s["name"] == f"{name}.tar" for s in self._base["shards"]):
                    raise DestinationError(f"{self.store.root}: shard {name}.tar already exists in the dataset; "
                                           f"append with another prefix")
                self._cur = ShardFile(self.store, name)
                self._new.append(name)
            self._cur.add(key, payloads)
        except (FormatError, ValueError) as exc:
            if not reject:
                if isinstance(exc, FormatError):
                    raise
                raise FormatError(f"{where}: {exc}") from None
            self._cur_rejects.append({"source": where, "key": key, "reason": f"invalid: {exc}"})
            return False
        self._cur_nbytes += n
        self._keys[key] = where
        for ext in payloads:
            self._cur_fields.setdefault(ext, mf.field_kind(ext))
        return True

    def _first_index(self) -> int:
        return len(self._base["shards"]) if self._base is not None else 0

    def _fields_differ(self, key: str, payloads: Mapping[str, Any], fields: Mapping[str, str], where: str) -> None:
        """Raise the InputError of a sample whose fields are not the dataset's, naming the fields."""
        have, want = set(payloads), set(fields)
        diff = "; ".join(x for x in (
            f"missing {sorted(want - have)}" if want - have else "",
            f"not in the dataset {sorted(have - want)}" if have - want else "") if x)
        rule = "appended samples must have the same fields" if self._base is not None else \
            "a dataset's fields are its first sample's, and every sample has exactly those"
        named = "" if where == f"sample {key!r}" else f" ({where})"
        raise InputError(f"sample {key!r}{named}: its fields {sorted(have)} are not the dataset's {sorted(want)} "
                         f"({diff}); {rule}")

    def _check_npy(self, key: str, payloads: Mapping[str, bytes | memoryview]) -> None:
        """An appended sample's `.npy` fields have the dataset's dtypes (and fixed shapes)."""
        for ext, (dtype, shape) in self._npy.items():
            try:
                got_dtype, got_shape = _npy_spec(payloads[ext])
            except FormatError as exc:
                raise FormatError(f"sample {key!r}: field {ext!r}: {exc}") from None
            if got_dtype != dtype or (shape is not None and got_shape != shape):
                raise InputError(
                    f"sample {key!r}: field {ext!r} is {np.dtype(got_dtype)} of shape {got_shape}, the dataset "
                    f"holds {np.dtype(dtype)}" + (f" of shape {shape}" if shape is not None else "")
                    + "; appended samples must have the same dtypes and shapes")

    def _finish_shard(self, next_at: tuple[int, int] | None = None) -> None:
        cur, self._cur = self._cur, None
        if cur is None:
            return
        entry = cur.finish()
        self.shards.append(entry)
        self.fields.update(self._cur_fields)
        self.rejects += self._cur_rejects
        rec = {"entry": entry, "fields": self._cur_fields, "rejects": self._cur_rejects,
               "next": list(next_at or self._origin or ()) or None, "classes": self._user_classes}
        self._cur_nbytes, self._cur_rejects, self._cur_fields = 0, [], {}
        if self._publisher is None:
            from concurrent.futures import ThreadPoolExecutor

            self._publisher = ThreadPoolExecutor(1, thread_name_prefix="gdsload-publish")
        self._publishing.append(self._publisher.submit(self._publish, cur, rec))
        self._published(wait=False)  # an earlier shard's failed publish stops the writer here

    def _publish(self, cur: ShardFile, rec: dict[str, Any]) -> None:
        """On the publisher thread, in shard order: the shard into place (its fsyncs), then its
        done record; nothing once an earlier shard failed (resume stops at the first gap)."""
        if self._publish_failed:
            cur.abort()
            return
        try:
            cur.publish()
            self.store.write(f"{STATE_DIR}/done/{cur.name}.json", json.dumps(rec).encode())
        except BaseException:
            self._publish_failed = True
            cur.abort()
            raise

    def _published(self, wait: bool) -> None:
        """Raise the first error of a shard's publish, after all of them ended (`wait`) or all
        but the newest (at most one shard waits to be published while the next is written)."""
        pending = self._publishing
        if wait and self._publisher is not None:
            self._publisher.shutdown(wait=True)
            self._publisher = None
        while pending and (wait or len(pending) > 1 or pending[0].done()):
            pending.pop(0).result()

    # -- finishing -------------------------------------------------------------------------------
    def close(self) -> dict[str, Any]:
        """Finish the last shard and write the manifest (last); returns it."""
        if self._closed:
            assert self.manifest is not None
            return self.manifest
        try:
            if self.manifest is None:
                self.manifest = self._close()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._stack.close()
        return self.manifest

    def _close(self) -> dict[str, Any]:
        if self._skip_at < len(self._skip):
            raise DestinationError(
                f"resume: only {self._skip_at} of the {len(self._skip)} samples the interrupted run wrote were "
                f"fed again: the input is not the same")
        if self._cur is not None:
            self._finish_shard()
        self._published(wait=True)
        self.fields.update(self._cur_fields)
        store = self.store
        rejects = self.rejects
        fp = {"fingerprint": self.fingerprint, "rejected": len(rejects)}
        if self._base is None:
            if not self.shards:
                store.remove_tree(STATE_DIR)
                raise InputError(f"{store.root}: no samples were written"
                                 + (f" (all {len(rejects)} rejected, first: {rejects[0]['reason']})" if rejects else ""))
            m = make_manifest(self.shards, self.fields, classes=self.classes, created={**self._created, **fp})
        else:
            m = self._appended_manifest(fp)
        old_rejects = store.read(REJECTED) if self._base is not None and store.exists(REJECTED) else b""
        if rejects or old_rejects:
            store.write(REJECTED, old_rejects + "".join(json.dumps(r) + "\n" for r in rejects).encode())
        save_manifest(store, m)
        store.remove_tree(STATE_DIR)
        return m

    def _appended_manifest(self, fp: dict[str, Any]) -> dict[str, Any]:
        base = dict(self._base or {})
        if not self.shards:
            self.store.remove_tree(STATE_DIR)
            raise InputError(f"{self.store.root}: nothing to append (no samples were written)")
        history = mf.versions(base)
        if history[-1].get("classes") is None and base.get("classes") is not None:
            history[-1] = {**history[-1], "classes": len(base["classes"])}
        shards = list(base["shards"]) + self.shards
        added = sum(s["samples"] for s in self.shards)
        version = {"version": history[-1]["version"] + 1, "shards": len(shards),
                   "num_samples": base["num_samples"] + added,
                   "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "appended": added,
                   "rejected": fp["rejected"], "fingerprint": fp["fingerprint"],  # what resume=True compares
                   **({"classes": len(self.classes)} if self.classes is not None else {}),
                   **{k: v for k, v in self._created.items() if k in ("source", "source_format")}}
        return {**base, "num_samples": version["num_samples"], "num_bytes": sum(s["bytes"] for s in shards),
                "shards": shards, "classes": self.classes,
                "versions": history + [version]}

    def abort(self) -> None:
        """Stop without a manifest. After a data error (a collision, a refused field) this
        writer's shards are removed: an append leaves the dataset as it was, a new dataset leaves
        nothing. Otherwise (an interrupt, a full disk, an error in user code) finished shards stay,
        for `resume=True`."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._cur is not None:
                self._cur.abort()
                self._cur = None
            with contextlib.suppress(BaseException):  # finished shards are complete: published
                self._published(wait=True)  # no thread writes here once abort returns
            if self._bad_data and self.manifest is None:
                for name in self._new:
                    for suffix in (".tar", ".idx", ".dali.idx"):
                        self.store.remove(name + suffix)
                self.store.remove_tree(STATE_DIR)
        finally:
            self._stack.close()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


# -- write(fn, inputs) ---------------------------------------------------------------------------
CHUNK_NBYTES = 8 << 20  # a worker sends its samples to the driver in chunks of about this size
CHUNK_SAMPLES = 256
QUEUE_CHUNKS = 4  # chunks in flight per worker: the memory bound of `write`

_FN: Callable[[Any], Iterable[Mapping[str, Any]]] | None = None  # set before forking workers
_INPUTS: Sequence[Any] | None = None


def _produce(fn: Callable[[Any], Iterable[Mapping[str, Any]]], item: Any, i: int,
             validate: bool, copy: bool = False) -> Iterator[tuple[str, Any]]:
    """`("sample", (key, payloads))` and `("reject", record)` for one input, in fn's order;
    `copy`: payloads as `bytes` (to be pickled to another process), not memoryviews."""
    result = fn(item)
    if result is None:
        return
    if isinstance(result, Mapping):
        result = [result]
    for j, sample in enumerate(result):
        if isinstance(sample, Mapping) and "__reject__" in sample:
            yield "reject", {"source": f"input {i} ({_short(item)})", "key": str(sample.get("__key__", "")),
                             "reason": str(sample["__reject__"])}
            continue
        try:
            key, payloads = encode_sample(sample)
            if validate:
                for ext, data in payloads.items():
                    if mf.field_kind(ext) == "image":
                        validate_image(bytes(data))
        except (FormatError, ValueError) as exc:
            key = sample.get("__key__", "") if isinstance(sample, Mapping) else ""
            yield "reject", {"source": f"input {i} ({_short(item)})", "key": str(key), "reason": f"invalid: {exc}"}
            continue
        yield "sample", (key, {k: bytes(v) for k, v in payloads.items()} if copy else payloads)


def _short(item: Any, limit: int = 80) -> str:
    """An input, for messages: its `source` where it has one (a listed file), else its repr."""
    source = getattr(item, "source", None)
    if isinstance(source, str):
        return source
    text = repr(item)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _worker(w: int, workers: int, start: int, queue: Any, validate: bool, fn: Any, inputs: Any) -> None:
    """Process worker `w` (see `_produce_all`)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops us
    fn = fn if fn is not None else _FN
    inputs = inputs if inputs is not None else _INPUTS
    _produce_all(w, workers, start, queue.put, validate, fn, inputs, copy=True)


def _produce_all(w: int, workers: int, start: int, put: Callable[[Any], None], validate: bool, fn: Any,
                 inputs: Sequence[Any], copy: bool) -> None:
    """Worker `w`: inputs `start + w, start + w + workers, ...`, each `put` in chunks, then
    `("end", i)`; an error in `fn` is sent as `("error", i, text)`."""
    for i in range(start + w, len(inputs), workers):
        chunk: list[tuple[str, Any]] = []
        nbytes = 0
        try:
            for item in _produce(fn, inputs[i], i, validate, copy):
                chunk.append(item)
                nbytes += sum(len(p) for p in item[1][1].values()) if item[0] == "sample" else 0
                if nbytes >= CHUNK_NBYTES or len(chunk) >= CHUNK_SAMPLES:
                    put(("chunk", i, chunk))
                    chunk, nbytes = [], 0
        except _StopThread:
            return
        except BaseException as exc:  # user code: report it, the driver raises it
            put(("error", i, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            return
        if chunk:
            put(("chunk", i, chunk))
        put(("end", i, None))


class _StopThread(Exception):
    """Raised in a thread worker's `put` once the driver stopped."""


def _until_stopped(*args: Any) -> None:
    """`_produce_all` in a thread, which ends quietly when the driver stops it."""
    try:
        _produce_all(*args)
    except _StopThread:
        pass


class _Threads:
    """The thread counterpart of `_Workers` (`executor="thread"`): the same round-robin and
    bounded queues, no pickling, so payloads may stay memoryviews (of Arrow buffers, say)."""

    def __init__(self, fn: Any, inputs: Sequence[Any], workers: int, start: int, validate: bool):
        import queue as queue_mod
        import threading

        self.workers, self.start = workers, start
        self.queues = [queue_mod.Queue(QUEUE_CHUNKS) for _ in range(workers)]
        self._stopped = threading.Event()

        def put_to(q: Any) -> Callable[[Any], None]:
            def put(msg: Any) -> None:
                while True:
                    if self._stopped.is_set():
                        raise _StopThread
                    try:
                        q.put(msg, timeout=0.2)
                        return
                    except queue_mod.Full:
                        continue
            return put

        self.threads = [threading.Thread(target=_until_stopped, name=f"gdsload-write-{w}", daemon=True,
                                         args=(w, workers, start, put_to(self.queues[w]), validate, fn, inputs, False))
                        for w in range(workers)]
        for t in self.threads:
            t.start()

    def items(self, i: int) -> Iterator[tuple[str, Any]]:
        q = self.queues[(i - self.start) % self.workers]
        while True:
            kind, _, payload = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise WriteFnError(i, payload)
            yield from payload

    def stop(self) -> None:
        self._stopped.set()
        for t in self.threads:
            t.join(10)


class _Workers:
    """`workers` processes producing inputs round-robin; `items(i)` yields input i's output in
    order. Each worker has its own bounded queue, so the driver, reading input by input, holds
    at most `QUEUE_CHUNKS` chunks per worker."""

    def __init__(self, fn: Any, inputs: Sequence[Any], workers: int, start: int, validate: bool):
        global _FN, _INPUTS
        fork = "fork" in mp.get_all_start_methods()
        ctx = mp.get_context("fork" if fork else "spawn")
        _FN, _INPUTS = (fn, inputs) if fork else (None, None)
        self.workers = workers
        self.start = start
        self.queues = [ctx.Queue(QUEUE_CHUNKS) for _ in range(workers)]
        self.procs = [ctx.Process(target=_worker, args=(w, workers, start, self.queues[w], validate,
                                                         None if fork else fn, None if fork else list(inputs)),
                                  daemon=True, name=f"gdsload-write-{w}") for w in range(workers)]
        for p in self.procs:
            p.start()
        _FN = _INPUTS = None

    def items(self, i: int) -> Iterator[tuple[str, Any]]:
        import queue as queue_mod

        q = self.queues[(i - self.start) % self.workers]
        proc = self.procs[(i - self.start) % self.workers]
        while True:
            try:
                kind, j, payload = q.get(timeout=1.0)
            except queue_mod.Empty:
                if not proc.is_alive():
                    raise GdsloadError(f"gdsload.write: worker {proc.name} died (exit code {proc.exitcode}) "
                                       f"while producing input {i}") from None
                continue
            if j != i:
                raise AssertionError(f"worker sent input {j}, expected {i}")  # unreachable
            if kind == "end":
                return
            if kind == "error":
                raise WriteFnError(i, payload)
            yield from payload

    def stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        for q in self.queues:
            q.cancel_join_thread()
            q.close()


class WriteFnError(GdsloadError):
    """The user's `fn` raised on one input (the writer keeps its finished shards for resume)."""

    def __init__(self, i: int, text: str):
        super().__init__(f"gdsload.write: fn raised on input {i}: {text.splitlines()[0]}")
        self.input = i
        self.add_note(text)


def _fingerprint_inputs(fn: Any, inputs: Sequence[Any]) -> str:
    """What resume compares: the function's name and the inputs' reprs (which must be stable:
    paths, numbers, strings, tuples of them)."""
    h = hashlib.sha256(f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', repr(fn))}".encode())
    for item in inputs:
        h.update(repr(item).encode("utf-8", "backslashreplace") + b"\n")
    return h.hexdigest()


def write(fn: Callable[[Any], Iterable[Mapping[str, Any]] | Mapping[str, Any] | None], inputs: Iterable[Any],
          dst: str | os.PathLike[str], *, workers: int = 1, shard_size: int | str = "1GiB",
          prefix: str = "shard", classes: Sequence[str] | None = None, append: bool = False,
          resume: bool = False, overwrite: bool = False, validate: bool = False, progress: bool = True,
          executor: str = "process", source_format: str = "api",
          created: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write the samples `fn(input)` yields for every input into a dataset at `dst`; returns the
    manifest.

    `fn` returns an iterable of sample dicts (zero or more: filtering is free), one dict, or None,
    and must be deterministic. It runs in `workers` processes (forked where the platform can:
    `fn` may then be a closure; elsewhere `fn` and `inputs` are pickled). Samples are written in
    input order, so the output bytes are the same for any `workers`. A sample the format refuses
    (or an image that does not decode, with `validate`) is left out and recorded in
    `rejected.jsonl`; a key collision is an error naming both inputs; an exception in `fn` stops
    the run (`WriteFnError`, naming the input) with finished shards kept for `resume=True`.
    `executor="thread"` runs `fn` in threads of this process instead: for an `fn` whose work
    releases the GIL (reading files, pyarrow), it saves pickling every sample to the writer, and
    samples may hold memoryviews (written without a copy). Other arguments: `ShardWriter`.
    """
    inputs = list(inputs)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InputError(f"workers must be a positive int, got {workers!r}")
    if executor not in ("process", "thread"):
        raise InputError(f"executor must be 'process' or 'thread', got {executor!r}")
    writer = ShardWriter(dst, shard_size, prefix=prefix, classes=classes, append=append, resume=resume,
                         overwrite=overwrite, validate=False, source_format=source_format,
                         created=created, fingerprint=_fingerprint_inputs(fn, inputs) + f"|{validate}")
    if writer.complete:
        writer.close()
        return writer.manifest  # type: ignore[return-value]
    start, skip = writer.resume_point or (0, 0)
    if writer.resume_point is not None:
        writer._skip_at = len(writer._skip)  # the kept shards end exactly at (start, skip)
    elif writer._skip:
        start = 0  # kept shards without positions: feed everything, the writer skips by key
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(inputs), initial=start, unit="input", desc="write", dynamic_ncols=True)
    pool: _Workers | _Threads | None = None
    if workers > 1 and start < len(inputs):
        pool = (_Workers if executor == "process" else _Threads)(
            fn, inputs, min(workers, len(inputs) - start), start, validate)
    try:
        with writer:
            for i in range(start, len(inputs)):
                stream = pool.items(i) if pool is not None else _produce(fn, inputs[i], i, validate)
                j = 0
                where = f"input {i} ({_short(inputs[i])})"  # once per input, not per sample
                try:
                    for kind, item in stream:  # j counts what fn yielded: samples and rejects
                        if i == start and j < skip:
                            j += 1
                            continue
                        writer._origin = (i, j)  # where the shard cut before this sample resumes
                        if kind == "reject":
                            writer._cur_rejects.append(item)
                            j += 1
                            continue
                        key, payloads = item
                        writer.add(key, payloads, where=where, reject=True)
                        j += 1
                except (GdsloadError, KeyboardInterrupt):
                    raise
                except Exception as exc:  # fn raised in this process (workers == 1)
                    raise WriteFnError(i, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}") from exc
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix_str(f"{len(writer.shards)} shards", refresh=False)
                writer._origin = (i + 1, 0)
    finally:
        if pool is not None:
            pool.stop()
        if bar is not None:
            bar.close()
    return writer.manifest  # type: ignore[return-value]
