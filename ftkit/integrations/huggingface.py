"""Hugging Face ``transformers.Trainer``: snapshots into ftkit tiers, and an exact resume.

::

    from ftkit.integrations.huggingface import FtkitCallback

    ftkit_cb = FtkitCallback(["/local/ckpt"], every_n_steps=50)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[ftkit_cb])
    with ftkit_cb:  # no exception hook in the Trainer: this flushes, and tells the peers of a failure
        trainer.train(resume_from_checkpoint=ftkit_cb.resume_from_checkpoint())  # None: nothing to resume

The Trainer moves its data loop only for a ``resume_from_checkpoint`` directory, so
``resume_from_checkpoint()`` restores the newest snapshot and writes one (_hf_resume.py); the
callback puts the optimizer, scheduler and GradScaler back in ``on_train_begin`` and the RNG
state where the Trainer's own resume sets it. On another number of ranks the loader continues
the one global sample stream (_hf_stream.py). FSDP2, limits and tests: docs/integrations.md.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import shutil
import sys
import weakref
from collections.abc import Sequence
from types import FrameType
from typing import Any

try:
    from transformers import TrainerCallback, TrainerState
    from transformers.trainer_callback import CallbackHandler, ExportableState
except ImportError:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "ftkit.integrations.huggingface needs transformers (and accelerate): pip install 'ftkit[huggingface]'"
    ) from None

import torch

from ftkit.checkpointer import Checkpointer
from ftkit.config import Tier
from ftkit.errors import FtkitError, StateMismatchError
from ftkit.integrations._common import Adapter, CallbackBase, Stash, check_tiers_reachable
from ftkit.integrations._hf_resume import check_fsdp_args, fsdp_plugin, is_own, write_resume_dir
from ftkit.integrations._hf_stream import (
    Layout,
    StreamPosition,
    continue_stream,
    planned_end,
    stream_ended,
    trainer_layout,
    why_not_continued,
)
from ftkit.save.capture import RankLocal
from ftkit.save.rng import rng_state, set_rng_state
from ftkit.tiers.redact import redact_url

log = logging.getLogger("ftkit.huggingface")

__all__ = ["FtkitCallback"]


class FtkitCallback(CallbackBase, TrainerCallback):
    """Snapshot a ``transformers.Trainer`` into ftkit tiers; resume it with ``resume_from_checkpoint()``.

    tiers: ftkit tiers (``Tier`` objects, URLs or dicts); opened when the Trainer is built.
    every_n_steps: snapshot when ``state.global_step`` is a multiple of this (a tier's
        ``every`` applies on top).
    policy: ``"wait"`` or ``"skip"`` when both staging buffers are busy (see ``Checkpointer``).
    resume_dir: where ``resume_from_checkpoint()`` writes the directory for ``train()``
        (default ``<output_dir>/ftkit-resume``; one all ranks see under FSDP); removed once
        training begins. A new or empty directory, or one ftkit wrote before: any other is
        refused, never emptied.
    ignore_existing: start from scratch even if the tiers hold snapshots (else an error).
    checkpointer_kwargs: passed to :class:`ftkit.Checkpointer` (``max_staging_bytes``).
    """

    def __init__(
        self,
        tiers: Sequence[Tier | str | dict] | Tier | str,
        every_n_steps: int = 1,
        *,
        policy: str = "wait",
        resume_dir: str | None = None,
        ignore_existing: bool = False,
        **checkpointer_kwargs: Any,
    ):
        if "rng" in checkpointer_kwargs:
            raise TypeError("FtkitCallback always snapshots the RNG state; 'rng' cannot be turned off here")
        super().__init__(tiers, every_n_steps, policy)
        self.resume_dir = resume_dir
        self.ignore_existing = ignore_existing
        self.checkpointer_kwargs = checkpointer_kwargs
        self._model: torch.nn.Module | None = None
        self._args: Any = None
        self._resume: dict[str, Any] | None = None  # loaded by resume_from_checkpoint(), applied in train()
        self._resume_path: str | None = None
        self._rng_due: Any = None  # RNG state to set at the first on_step_begin after a resume
        self._atexit = False
        self._layout: Layout | None = None  # how the Trainer reads the sample stream (_hf_stream.py)
        self._stop_at: int | None = None  # the step at which a continued stream's planned epochs end
        self._end: int | None = None  # where the planned epochs of a continued stream end, in samples
        self._fsdp = False  # the Trainer trains under FSDP2 (set by resume_from_checkpoint)
        self._handler: CallbackHandler | None = None  # the Trainer's callbacks, and its control (on_train_begin)
        self._control: Any = None

    def _entries(self, model, optimizer, scheduler, trainer_state, world_size: int = 1) -> dict[str, Any]:
        """The same keys for snapshot and restore; `None` parts become stashes. "rng" is each
        rank's own; "world": the snapshot's world size and stream position (_hf_stream.py)."""

        def job() -> dict[str, Any]:
            at = self._layout.position(trainer_state.global_step) if self._layout is not None else None
            if at is not None and self._end is not None:  # a last step may pad past the end of the stream
                at = StreamPosition(min(at.samples, self._end), at.per_epoch)
            return {"world_size": world_size, "stream": dataclasses.asdict(at) if at is not None else None}

        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
        scaler = getattr(optimizer, "scaler", None)
        return {
            "model": model,
            "optimizer": inner if inner is not None else Stash(dict),
            "scheduler": scheduler if scheduler is not None else Stash(dict),
            "scaler": (Adapter(scaler.state_dict, scaler.load_state_dict) if scaler is not None else Stash(dict)),
            "trainer_state": (
                Adapter(lambda: self._trainer_state_json(trainer_state), lambda v: None)
                if trainer_state is not None
                else Stash(str)
            ),
            "rng": RankLocal(Adapter(rng_state, lambda v: None) if trainer_state is not None else Stash(dict)),
            "world": Adapter(job, lambda v: None) if trainer_state is not None else Stash(dict),
        }

    def _trainer_state_json(self, trainer_state) -> str:
        """The Trainer's state as its own save writes it: with the callbacks' states (ExportableState,
        which ``restore_callback_states_from_checkpoint`` restores) as of now, not of its last save."""
        doc = dataclasses.asdict(trainer_state)
        if self._handler is not None:
            live = [cb for cb in [*self._handler.callbacks, self._control] if isinstance(cb, ExportableState)]
            doc["stateful_callbacks"] = TrainerState(stateful_callbacks=live).stateful_callbacks
        return json.dumps(doc, sort_keys=True)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        check_fsdp_args(args)
        check_tiers_reachable(self.tiers, "FtkitCallback")
        self._model = model
        self._args = args

    def resume_from_checkpoint(self) -> str | None:
        """Restore the newest snapshot's weights (the rest when training begins); return the
        directory to pass to ``Trainer.train``, or ``None`` when there is none. Every rank calls it."""
        if self._model is None:
            raise FtkitError(
                "resume_from_checkpoint(): pass this callback to the Trainer first (Trainer(..., callbacks=[ftkit_cb]))"
            )
        entries = self._entries(self._model, None, None, None)
        rng = entries["rng"].value
        with Checkpointer(entries, self.tiers, rng=False, **self.checkpointer_kwargs) as ck:
            step = ck.restore()
        if step == 0:
            self._resume = None
            return None
        self._resume = {"step": step, **{k: v.take() for k, v in entries.items() if isinstance(v, Stash)}}
        self._resume["rng"] = rng.take()  # None: a rank the snapshot did not have
        path = self.resume_dir or os.path.join(self._args.output_dir, "ftkit-resume")
        plugin = fsdp_plugin()
        self._fsdp = plugin is not None
        if self._fsdp:
            # on_train_begin restores this step again into the live sharded optimizer.
            self._resume["optimizer"] = self._resume["scheduler"] = self._resume["scaler"] = None
        self._resume_path = path = write_resume_dir(
            self._model, path, self._resume["trainer_state"], self._args.world_size, self._args.process_index, plugin
        )
        log.info("ftkit: step %d restored; resume directory %s", step, path)
        return path

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        self._close_quietly()
        self._last_step = -1
        self.restored_step = 0
        resume, self._resume = self._resume, None
        if not self._fsdp:
            self._remove_resume_dir()  # (under FSDP, after the restore below: other ranks may still read it)
        if resume is not None:
            if state.global_step != resume["step"]:
                raise FtkitError(
                    f"ftkit restored step {resume['step']} but the Trainer starts at step "
                    f"{state.global_step}: pass the directory to train(): "
                    "trainer.train(resume_from_checkpoint=ftkit_cb.resume_from_checkpoint())"
                )
            if not self._fsdp:
                self._load_training_objects(optimizer, lr_scheduler, resume)
            self._rng_due = resume["rng"]
            self.restored_step = self._last_step = resume["step"]
        elif state.global_step == 0 and not self.ignore_existing:
            for url, steps in check_tiers_reachable(self.tiers, "FtkitCallback").items():
                if steps:
                    raise FtkitError(
                        f"ftkit tier {redact_url(url)} holds snapshots up to step {max(steps)}; resume with "
                        "trainer.train(resume_from_checkpoint=ftkit_cb.resume_from_checkpoint()), or "
                        "pass FtkitCallback(..., ignore_existing=True) to start over"
                    )
        self._follow_stream(args, state, resume, kwargs.get("train_dataloader"))
        self._handler, self._control = _calling_handler(self), control
        entries = self._entries(model, optimizer, lr_scheduler, state, args.world_size)
        self.checkpointer = Checkpointer(entries, self.tiers, policy=self.policy, rng=False, **self.checkpointer_kwargs)
        if resume is None:  # (ignore_existing, or a Trainer checkpoint of its own): an earlier run's newer steps go
            self.checkpointer.continue_from(state.global_step)
        if resume is not None and self._fsdp:
            self._restore_sharded(resume["step"], args)
        if not self._atexit:  # no exception hook in the Trainer: flush at exit at the latest
            atexit.register(_close_at_exit, weakref.ref(self))
            self._atexit = True

    def _follow_stream(self, args, state, resume: dict[str, Any] | None, loader) -> None:
        """Make the Trainer's loader continue the snapshot's place in the sample stream, or say why
        the Trainer's own arithmetic decides (_hf_stream.py)."""
        found = trainer_layout(args, loader)
        self._layout, self._stop_at, self._end = (found[0] if found else None), None, None
        if resume is None:
            return
        job = resume.get("world")
        job = job if isinstance(job, dict) else {}  # (read back from the snapshot: untrusted)
        saved_world, saved = job.get("world_size", 1), StreamPosition.from_json(job.get("stream"))
        why = why_not_continued(args, found, saved)
        if why is not None:
            if saved_world != args.world_size or (saved is not None and not args.ignore_data_skip):
                log.warning(
                    "ftkit: resuming step %d (a %s-rank snapshot, %d ranks now) without its place in the sample "
                    "stream (%s): the Trainer's own epoch and batch skipping decide where the data resumes",
                    resume["step"],
                    saved_world,
                    args.world_size,
                    why,
                )
            if args.ignore_data_skip:
                self._layout = None  # the epoch starts over: positions it would record would not be the stream's
            return
        assert found is not None and saved is not None
        layout, outer, sampler = found
        epochs = args.num_train_epochs if args.max_steps <= 0 else None
        self._layout, self._stop_at = continue_stream(saved, layout, outer, sampler, state.global_step, epochs)
        self._end = planned_end(epochs, saved)
        if saved_world != args.world_size:
            log.info(
                "ftkit: step %d of a %d-rank run continues on %d ranks at sample %d of the stream%s",
                resume["step"],
                saved_world,
                args.world_size,
                saved.samples,
                f"; the planned epochs end at step {self._stop_at}" if self._stop_at is not None else "",
            )

    def _restore_sharded(self, step: int, args) -> None:
        """FSDP2: the same step again, into the live sharded model and optimizer. Its vote means
        every rank is past the Trainer's load, so rank 0 then removes the shared resume directory."""
        assert self.checkpointer is not None
        got = self.checkpointer.restore(step)
        if got != step:
            raise FtkitError(f"ftkit restored step {step} for the Trainer, then step {got} into the sharded state")
        if args.process_index == 0:
            self._remove_resume_dir()
        self._resume_path = None

    def _load_training_objects(self, optimizer, lr_scheduler, resume: dict[str, Any]) -> None:
        try:
            optimizer.load_state_dict(resume["optimizer"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise StateMismatchError(f"optimizer: the snapshot does not fit the Trainer's optimizer: {e}") from e
        if lr_scheduler is not None and resume["scheduler"]:
            lr_scheduler.load_state_dict(resume["scheduler"])
        scaler = getattr(optimizer, "scaler", None)
        if scaler is not None and resume["scaler"]:
            scaler.load_state_dict(resume["scaler"])

    def on_step_begin(self, args, state, control, **kwargs):
        # Step N is snapshotted as step N+1 begins: after its logging and evaluation, with the
        # RNG state where a resume sets it (the next step's batches already fetched).
        if self._rng_due is not None:
            rng, self._rng_due = self._rng_due, None
            set_rng_state(rng)
        self._maybe_snapshot(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if stream_ended(self._stop_at, state.global_step):  # a continued stream's planned epochs are done
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        try:
            self._maybe_snapshot(state.global_step, last=True)  # the trained model, whatever every_n_steps says
        finally:
            self.close()  # flushes; a failed background persist is raised here

    def _end_checkpointer(self, exc_type, exc, tb) -> None:
        try:
            super()._end_checkpointer(exc_type, exc, tb)
        finally:  # (the handler holds the Trainer's model, optimizer and loaders: not past training)
            self._handler = self._control = None

    def __enter__(self) -> FtkitCallback:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close; when ``train()`` raised, end as the Checkpointer's own ``with`` block does."""
        self._end_checkpointer(exc_type, exc, tb)

    def _remove_resume_dir(self) -> None:
        path, self._resume_path = self._resume_path, None
        if path and os.path.isdir(path) and is_own(path):  # (a directory ftkit did not write is never removed)
            shutil.rmtree(path, ignore_errors=True)


def _calling_handler(callback: FtkitCallback) -> CallbackHandler | None:
    """The Trainer's CallbackHandler calling `callback`, found on the call stack: a callback is not
    handed the others, whose states the Trainer's own save writes."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, CallbackHandler) and any(cb is callback for cb in owner.callbacks):
            return owner
        frame = frame.f_back
    return None


def _close_at_exit(ref: weakref.ref[FtkitCallback]) -> None:
    cb = ref()
    if cb is not None:
        cb._close_quietly()
