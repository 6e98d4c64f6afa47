'''The HF `transformers.Trainer` fed by a gdsload loader and resumed exactly: `GdsloadStateCallback`.

The Trainer builds its own torch DataLoader, saves no loader state in its checkpoints, and on
`train(resume_from_checkpoint=...)` skips the batches already trained on. With gdsload, hand it
the loader, keep it from skipping, and add the callback, which keeps `loader.state_dict()` in
every checkpoint and loads it back when training resumes:

    import transformers
    from gdsload.integrations.hf import GdsloadStateCallback

    class Trainer(transformers.Trainer):
        def get_train_dataloader(self):
            return loader                 # a gdsload.DataLoader (or RemoteLoader)
        def get_resumed_dataloader(self, dataloader, num_batches):
            return dataloader             # the callback restored its position: nothing to skip

    trainer = Trainer(model=model, args=args, callbacks=[GdsloadStateCallback(loader)])
    trainer.train(resume_from_checkpoint=True)   # or the checkpoint folder; None the first time

How transformers (5.25) resumes, and why `get_resumed_dataloader` is overridden: when a
checkpoint is loaded, `Trainer._init_training_state` sets `steps_trained_in_current_epoch` to
`global_step % updates_per_epoch * gradient_accumulation_steps` (0 with `ignore_data_skip=True`),
and `_run_epoch` of the resumed epoch passes that to `get_resumed_dataloader`, whose default is
accelerate's `skip_first_batches`: it rebuilds a torch DataLoader from the loader's `sampler`
(a gdsload loader has none: that fails, naming this recipe) to skip them. Returning the loader
unchanged keeps the Trainer's own counting (its step within the epoch, the fraction of the epoch,
where gradient accumulation steps the optimizer, the RNG state it restores after the skip) that of
the uninterrupted run while the loader yields exactly the batches after the checkpoint: the same
keys and the same final weights, bit for bit, also with `gradient_accumulation_steps=5` over
epochs of 12 batches (`examples/hf_trainer_resume.py --grad-accum 5`). `ignore_data_skip=True`
also avoids the second skip, but the Trainer then counts the resumed epoch from its start: in that
same run it trained on the same keys but made 5 optimizer steps instead of 6 and ended with other
weights (with one batch per step it matched).

Where the state goes: the callback is an `ExportableState`, so its state, `{"loader_state":
loader.state_dict()}`, is written by the Trainer into each checkpoint's `trainer_state.json`
(under `"stateful_callbacks"`, with the global step it belongs to), and read back from there: no
file of its own, nothing to find. A resumed run (global step > 0) whose checkpoint has no loader
state (saved without this callback) is refused with a `GdsloadError`, as is a loader without
`state_dict`/`load_state_dict`. `GdsloadStateCallback()` without a loader uses the Trainer's
training dataloader, which is what `get_train_dataloader` returned (so it also works with
`restore_callback_states_from_checkpoint=True`, which rebuilds callbacks from their saved state).

Also: the Trainer takes `len(loader)` batches per epoch and calls `set_epoch(epoch)` before each
(a no-op for the epoch the loader is at); the order comes from the loader's `seed`, not
`args.seed`; `per_device_train_batch_size` batches nothing here, the Trainer only counts and
logs with it (set it to the loader's `batch_size`). The state is global (the same on every
rank); on several processes the loader takes rank and world size from the `torch.distributed`
group the Trainer sets up, at its first `len()` or `iter()` (so it may be built before), or from
`rank=`/`world_size=`. With `gradient_accumulation_steps > 1` the Trainer fetches that many
batches before using them, which gdsload allows (a batch still referenced is never written over).
'''

from __future__ import annotations

from typing import Any

from gdsload.errors import GdsloadError, MissingDependencyError

__all__ = ["GdsloadStateCallback"]

_BUILT: dict[str, type] = {}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise MissingDependencyError(
            f"gdsload.integrations.hf needs the HF transformers library (pip install transformers): {exc}"
        ) from exc
    return transformers


def _build() -> type:
    """The callback class, made on first use: it subclasses transformers' `TrainerCallback` (no-op
    hooks for every event the Trainer sends) and `ExportableState`."""
    from transformers.trainer_callback import ExportableState, TrainerCallback

    class GdsloadStateCallback(TrainerCallback, ExportableState):
        """Keeps a gdsload loader's `state_dict()` in every checkpoint of a `transformers.Trainer`
        and restores it when training resumes (`gdsload.integrations.hf`).

        `loader`: the loader the Trainer trains on; None: the Trainer's training dataloader."""

        def __init__(self, loader: Any = None):
            if loader is not None:
                _check_loader(loader, "GdsloadStateCallback(loader)")
            self.loader = loader

        def state(self) -> dict[str, Any]:
            loader_state = self.loader.state_dict() if self.loader is not None else None
            return {"args": {}, "attributes": {"loader_state": loader_state}}

        def on_train_begin(self, args: Any, state: Any, control: Any, train_dataloader: Any = None, **kwargs: Any):
            if self.loader is None:
                self.loader = _check_loader(train_dataloader, "the Trainer's training dataloader")
            if state.global_step > 0:  # resumed from a checkpoint: its trainer_state.json is `state`
                self.loader.load_state_dict(_saved_state(state, type(self).__name__))

    GdsloadStateCallback.__qualname__ = "GdsloadStateCallback"  # found again by name (pickle, repr)
    return GdsloadStateCallback


def _check_loader(loader: Any, what: str) -> Any:
    if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))):
        raise GdsloadError(f"{what} must be a gdsload loader (or another with state_dict/load_state_dict), "
                           f"got {type(loader).__name__}: override Trainer.get_train_dataloader to return "
                           f"it (gdsload.integrations.hf)")
    return loader


def _saved_state(state: Any, name: str) -> dict[str, Any]:
    """The loader state in a resumed Trainer's state (its checkpoint's `trainer_state.json`)."""
    saved = (state.stateful_callbacks or {}).get(name)
    if isinstance(saved, list):  # several callbacks of this class: the loader state is global, take the first
        saved = saved[0] if saved else None
    loader_state = (saved or {}).get("attributes", {}).get("loader_state")
    if loader_state is None:
        raise GdsloadError(
            f"resuming at global step {state.global_step}, but the checkpoint holds no gdsload loader state "
            f"(it was saved without {name}): the loader cannot know where the run stopped; resume from a "
            f"checkpoint saved with the callback, or load a state into the loader yourself and drop the callback")
    return loader_state


def __getattr__(name: str) -> Any:
    if name == "GdsloadStateCallback":
        _transformers()
        if name not in _BUILT:
            _BUILT[name] = _build()
        return _BUILT[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
