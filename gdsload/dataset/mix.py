"""`gdsload.Mix`: several datasets read as one, in proportions (the user object).

The order math (`MixSpec`, `mix_order`, `MixPlan`) is the plan layer's, `gdsload.plan.mix`, whose
docstring gives the semantics. This module holds what opens datasets: the per-process shard view
and the `Source` interface a loader reads.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence
from pathlib import PurePosixPath
from typing import Any, Literal

import numpy as np

from gdsload.host.forksafe import ProcessLocal
from gdsload.plan.mix import MIX_BY, MixSource, MixSpec, check_schedule
from gdsload.plan.plan import PlanError, _int

__all__ = ["Mix"]


# --------------------------------------------------------------------------------------------
# the user's description


def _per_dataset(name: str, value: Any, k: int) -> list[Any]:
    if value is None:
        return [None] * k
    if isinstance(value, (str, bytes)) or not isinstance(value, (Sequence, np.ndarray)):
        raise PlanError(f"{name} must be a list with one entry per dataset ({k}), got {value!r}")
    value = list(value)
    if len(value) != k:
        raise PlanError(f"{name} has {len(value)} entries for {k} datasets; give one per dataset")
    return value


def _number(name: str, value: Any, *, positive: bool) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise PlanError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not np.isfinite(value) or value < 0 or (positive and value == 0):
        raise PlanError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
    return value


def _default_name(entry: Any) -> str:
    path = entry if isinstance(entry, str) else getattr(entry, "path", None)
    if not isinstance(path, str) or not path:
        raise PlanError(f"cannot name dataset {entry!r}; pass names=[...]")
    return PurePosixPath(path.rstrip("/")).name or path


class Mix(ProcessLocal):
    """Several datasets read as one, in proportions: ``Mix([a, b], weights=[0.7, 0.3])``.

    `datasets`: `gdsload.Dataset` objects, or strings: paths for a `DataLoader` (opened as
    `Dataset(path)`), served dataset names for a `RemoteLoader`. `weights`: one per dataset
    (relative, >= 0), or None for weights equal to the datasets' sizes. `samples_per_epoch`: the
    epoch's size (default: the sum of the datasets; see the module docstring). `repeat`/`samples`:
    optional, one entry per dataset (None where unused): fix that dataset's count per epoch to
    ``repeat * len(dataset)`` or to `samples` instead of a share by weight (its weight must then
    be None). `mix_by`: "sample" (positions drawn independently) or "batch" (each global batch
    from one dataset). `names`: the "__source__" name of each dataset (default: folder names).

    A Mix is a description; the order it gives is `mix_order` (pure). With opened datasets it
    offers what the loader reads from a `Dataset` (`dataset_id`, `shard_sizes`, `fields`,
    `shards`), the datasets' shards one after another.

    `schedule` (a `gdsload.TokenLoader` only: its weights are tokens): ``[(tokens, weights), ...]``,
    from each count of tokens consumed (the whole run's, epochs before included) the weights are
    those (one per dataset); `weights` hold before the first. `gdsload.plan.tokenmix` has the rule.
    """

    def __init__(
        self,
        datasets: Sequence[Any],
        weights: Sequence[float | None] | None = None,
        samples_per_epoch: int | None = None,
        *,
        repeat: Sequence[float | None] | None = None,
        samples: Sequence[int | None] | None = None,
        mix_by: Literal["sample", "batch"] = "sample",
        names: Sequence[str] | None = None,
        schedule: Sequence[tuple[int, Sequence[float]]] | None = None,
    ):
        if isinstance(datasets, (str, bytes)) or not isinstance(datasets, Sequence) or not datasets:
            raise PlanError(f"Mix takes a non-empty list of datasets, got {datasets!r}")
        self.datasets = list(datasets)
        k = len(self.datasets)
        if mix_by not in MIX_BY:
            raise PlanError(f"mix_by must be 'sample' or 'batch', got {mix_by!r}")
        self.mix_by = mix_by
        if samples_per_epoch is not None:
            samples_per_epoch = _int("samples_per_epoch", samples_per_epoch, minimum=1)
        self.samples_per_epoch = samples_per_epoch
        w = _per_dataset("weights", weights, k)
        r = _per_dataset("repeat", repeat, k)
        s = _per_dataset("samples", samples, k)
        self.weights: list[float | None] = []
        self.repeat: list[float | None] = []
        self.samples: list[int | None] = []
        for i in range(k):
            if r[i] is not None and s[i] is not None:
                raise PlanError(f"dataset {i} has both repeat={r[i]!r} and samples={s[i]!r}; give one")
            fixed = r[i] is not None or s[i] is not None
            if fixed and w[i] is not None:
                raise PlanError(f"dataset {i} has a weight ({w[i]!r}) and also repeat/samples; "
                                f"give one (set its weight to None)")
            if weights is not None and not fixed and w[i] is None:
                raise PlanError(f"dataset {i} has no weight (None) and no repeat/samples")
            self.weights.append(None if w[i] is None else _number(f"weights[{i}]", w[i], positive=False))
            self.repeat.append(None if r[i] is None else _number(f"repeat[{i}]", r[i], positive=True))
            if s[i] is not None:
                s[i] = _int(f"samples[{i}]", s[i], minimum=0)
            self.samples.append(s[i])
        self._weights_given = weights is not None
        if names is None:
            names = [_default_name(d) for d in self.datasets]
            if len(set(names)) != k:
                raise PlanError(f"datasets of the mix share a folder name ({names}); pass names=[...]")
        else:
            names = _per_dataset("names", names, k)
            if not all(isinstance(n, str) and n for n in names) or len(set(names)) != k:
                raise PlanError(f"names must be {k} different non-empty strings, got {names!r}")
        self.names = list(names)
        self.schedule = check_schedule(schedule, k)
        if self.schedule and any(x is not None for x in self.repeat + self.samples):
            raise PlanError("a weight schedule changes weights: every dataset needs a weight (no repeat/samples)")
        self._fields: list[str] | None = None
        self._start_process()

    def _init_process_local(self) -> None:
        self._concat = None  # the datasets' open shards, per process (rebuilt after a fork)

    # -- resolving ----------------------------------------------------------------------------
    def spec_with(self, described: Sequence[tuple[str, Sequence[int]]]) -> MixSpec:
        """The `MixSpec` given each dataset's (dataset_id, shard_sizes) (a server's answer, for
        a remote mix)."""
        sources = []
        for i, (dataset_id, sizes) in enumerate(described):
            sizes = tuple(int(n) for n in sizes)
            fixed = self.repeat[i] is not None or self.samples[i] is not None
            weight = None if fixed else (self.weights[i] if self._weights_given else float(sum(sizes)))
            sources.append(MixSource(name=self.names[i], dataset_id=str(dataset_id), shard_sizes=sizes,
                                     weight=weight, repeat=self.repeat[i], samples=self.samples[i]))
        return MixSpec(tuple(sources), self.samples_per_epoch, self.mix_by, schedule=self.schedule)

    def open(self, opener: Callable[[str], Any]) -> Mix:
        """This mix with every string entry replaced by ``opener(entry)`` (a `Dataset`)."""
        if all(not isinstance(d, str) for d in self.datasets):
            return self
        out = copy.copy(self)
        out.datasets = [opener(d) if isinstance(d, str) else d for d in self.datasets]
        out.__dict__.pop("spec", None)
        out._concat = None
        return out

    def _opened(self) -> list[Any]:
        if any(isinstance(d, str) for d in self.datasets):
            raise PlanError("this Mix names datasets by string; open them first (a DataLoader does)")
        return self.datasets

    @functools.cached_property
    def spec(self) -> MixSpec:
        """The resolved mix (needs opened datasets)."""
        return self.spec_with([(d.dataset_id, d.shard_sizes) for d in self._opened()])

    # -- what the loader reads from a Dataset -------------------------------------------------
    @property
    def dataset_id(self) -> str:
        return self.spec.mix_id

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        return self.spec.shard_sizes

    @property
    def fields(self) -> list[str]:
        """The selected fields, by default those every dataset has (first dataset's order)."""
        if self._fields is not None:
            return list(self._fields)
        ds = self._opened()
        return [f for f in ds[0].fields if all(f in d.fields for d in ds[1:])]

    @property
    def parts(self) -> list[Any]:
        return self._opened()

    def make_plan(self, **plan_args: Any) -> Any:
        """The `gdsload.plan.mix.MixPlan` of this mix with the loader's order options."""
        from gdsload.plan.mix import MixPlan

        if self.schedule:
            raise PlanError("a Mix with a weight schedule (weights by tokens consumed) is read by "
                            "gdsload.TokenLoader; a DataLoader or RemoteLoader mixes samples")
        return MixPlan(dataset_id=self.dataset_id, shard_sizes=self.shard_sizes, mix=self.spec, **plan_args)

    def select(self, fields: Sequence[str]) -> Mix:
        return self.with_fields(fields)

    def with_fields(self, fields: Sequence[str]) -> Mix:
        """This mix reading `fields` only; each must be in every dataset."""
        fields = list(fields)
        for i, d in enumerate(self._opened()):
            missing = [f for f in fields if f not in d.fields]
            if missing:
                raise PlanError(f"fields {missing} are not in dataset {i} ({self.names[i]!r}) of the "
                                f"mix (it has {sorted(d.fields)}); a mix reads fields all its datasets have")
        out = copy.copy(self)
        out._fields = fields
        return out

    @property
    def shards(self):
        """The datasets' shards one after another (`gdsload.dataset.concat.ConcatShards`)."""
        self._check_process()
        if self._concat is None:
            from gdsload.dataset.concat import ConcatShards

            parts = [d.shards for d in self._opened()]
            self._concat = ConcatShards(parts, fields=self.fields)
        return self._concat

    def sources_of(self, ids: np.ndarray) -> list[str]:
        """The "__source__" name of each global id."""
        which = np.searchsorted(self.spec.offsets[1:], np.asarray(ids), side="right")
        return [self.names[i] for i in which.tolist()]

    def __len__(self) -> int:
        """Samples of one epoch (with mix_by="batch" a loader rounds to whole global batches)."""
        return int(self.spec.counts().sum())

    def __repr__(self) -> str:
        return (f"gdsload.Mix({self.names}, weights={self.weights}, samples_per_epoch="
                f"{self.samples_per_epoch}, mix_by={self.mix_by!r}"
                + (f", schedule={[(a, list(w)) for a, w in self.schedule]}" if self.schedule else "") + ")")
