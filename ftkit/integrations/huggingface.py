"""Hugging Face ``transformers.Trainer``: snapshots into ftkit tiers, and an exact resume.

::

    from ftkit.integrations.huggingface import FtkitCallback

    ftkit_cb = FtkitCallback(["/local/ckpt"], every_n_steps=50)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[ftkit_cb])
    trainer.train(resume_from_checkpoint=ftkit_cb.resume_from_checkpoint())   # None: nothing to resume

Why the one extra call: the ``Trainer`` decides which epoch and batch to start from,
and skips the batches already trained on, only from the ``resume_from_checkpoint``
it is handed; no callback can move its data loop. ``resume_from_checkpoint()`` loads
the newest valid ftkit snapshot (checksums verified, a model that does not fit is a
``StateMismatchError`` naming the keys, and nothing is changed) and writes a small
directory for ``train()``: ``trainer_state.json`` (epoch, ``global_step``, log
history) and the restored weights (``save_pretrained``, safetensors). There is no
optimizer, scheduler or RNG file in it: the callback puts those back itself, the
optimizer, LR scheduler and AMP ``GradScaler`` in ``on_train_begin`` (once the Trainer
has built them) and the RNG state (Python, numpy, torch, CUDA) at the first
``on_step_begin``, the point where the Trainer's own resume sets it: after the
skipped batches and the next step's batches are fetched. The directory is removed
once training has begun.

Snapshots are taken at ``on_step_begin``, when ``state.global_step`` is a multiple of
``every_n_steps``: the state *after* that step, including its logging and evaluation,
and the RNG state at the point the resume sets it, which is what makes the resumed run
repeat the uninterrupted one bit for bit (given a deterministic data collator). The last
step of a run is snapshotted at ``on_train_end``. Snapshots are asynchronous: the step
waits only for the copy into staging memory.

If the tiers already hold snapshots and ``train()`` was not given
``resume_from_checkpoint()``, ``on_train_begin`` raises instead of starting over (which
would let retention delete the run's snapshots); ``ignore_existing=True`` starts over.

Several processes (torchrun, DDP through accelerate): every rank calls
``resume_from_checkpoint()`` (the restore is collective), gets a resume directory of its
own (``<resume_dir>-r<rank>``), and restores its own RNG state (a
:class:`~ftkit.RankLocal` entry); the Trainer's sharded data loader skips the same batches
on every rank as in its own resume, which is exact when the number of ranks is the same.
On another number of ranks the Trainer's epoch and skip arithmetic (steps per epoch) is
not the interrupted run's; the snapshot records the job's place in the one global sample
stream, and the callback makes the Trainer's loader serve each epoch the Trainer runs as
the window of that stream that continues it (_hf_stream.py): every sample once, in order.
The run's length stays the Trainer's (``max_steps``, or ``num_train_epochs`` x the new
world's steps per epoch); on fewer ranks the callback stops it where the planned epochs
of the stream end. A sampler accelerate cannot reproduce (``use_seedable_sampler=False``,
a custom one) leaves the Trainer's own arithmetic, with a warning.

FSDP2 (accelerate's plugin, ``fsdp_config={"version": 2}``): the Trainer loads the weights
itself after sharding, from its own FSDP files, so ``resume_from_checkpoint()`` writes the
restored weights in that layout into one resume directory all ranks see (_hf_resume.py), and
``on_train_begin`` restores the same step into the live sharded model and optimizer.

Limits, checked at ``Trainer`` construction: no DeepSpeed, FSDP1 or XLA's FSDP (they keep
their own flat shards). A collator that draws random
numbers (MLM masking) makes the first resumed batch differ, as it does with the
Trainer's own resume. ``transformers.Trainer`` has no exception hook: a failed
``train()`` leaves the last snapshots flushing in the background; call
``ftkit_cb.close()`` in a ``finally``, or better run ``train()`` inside ``with ftkit_cb:``,
which also tells the other ranks at once that this one failed (as the Checkpointer's own
``with`` block does) instead of leaving them in a collective until their timeout.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import shutil
import weakref
from collections.abc import Sequence
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - depends on what is installed
    raise ImportError(
        "ftkit.integrations.huggingface needs transformers (and accelerate): pip install 'ftkit[huggingface]'"
    ) from None

import torch

from ftkit.checkpointer import Checkpointer
from ftkit.config import Tier
from ftkit.errors import FtkitError, StateMismatchError
from ftkit.integrations._common import Adapter, Stash, check_every, check_tiers_reachable, coerce_tiers
from ftkit.integrations._hf_resume import check_fsdp_args, fsdp_plugin, write_resume_dir
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

log = logging.getLogger("ftkit.huggingface")

__all__ = ["FtkitCallback"]


class FtkitCallback(TrainerCallback):
    """Snapshot a ``transformers.Trainer`` into ftkit tiers; resume it with ``resume_from_checkpoint()``.

    tiers: ftkit tiers (``Tier`` objects, URLs or dicts), as for :class:`ftkit.Checkpointer`;
        opened and listed when the Trainer is constructed, so an unreachable tier fails there.
    every_n_steps: snapshot when ``state.global_step`` is a multiple of this (a tier's own
        ``every`` applies on top).
    policy: ``"wait"`` or ``"skip"`` when both staging buffers are busy (see ``Checkpointer``).
    resume_dir: where ``resume_from_checkpoint()`` writes the directory for ``train()``
        (default: ``<output_dir>/ftkit-resume``); it is removed when training begins.
    ignore_existing: start from scratch even if the tiers hold snapshots.
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
        self.tiers = coerce_tiers(tiers)
        self.every_n_steps = check_every(every_n_steps)
        self.policy = policy
        self.resume_dir = resume_dir
        self.ignore_existing = ignore_existing
        self.checkpointer_kwargs = checkpointer_kwargs
        self.checkpointer: Checkpointer | None = None
        self.restored_step = 0  # the step train() resumed from (0: started fresh)
        self._model: torch.nn.Module | None = None
        self._args: Any = None
        self._resume: dict[str, Any] | None = None  # loaded by resume_from_checkpoint(), applied in train()
        self._resume_path: str | None = None
        self._rng_due: Any = None  # RNG state to set at the first on_step_begin after a resume
        self._last_step = -1
        self._atexit = False
        self._layout: Layout | None = None  # how the Trainer reads the sample stream (_hf_stream.py)
        self._stop_at: int | None = None  # the step at which a continued stream's planned epochs end
        self._end: int | None = None  # where the planned epochs of a continued stream end, in samples
        self._fsdp = False  # the Trainer trains under FSDP2 (set by resume_from_checkpoint)

    # ----------------------------------------------------------------- state
    def _entries(self, model, optimizer, scheduler, trainer_state, world_size: int = 1) -> dict[str, Any]:
        """The same keys for snapshot and restore; `None` parts become stashes. "rng" is each
        rank's own; "world" the number of ranks that took the snapshot and the job's position
        in the sample stream (_hf_stream.py), the same on every rank."""

        def job() -> dict[str, Any]:
            layout, end = self._layout, self._end
            if layout is None:
                return {"world_size": world_size, "stream": None}
            at = layout.position(trainer_state.global_step)
            if end is not None and at.samples > end:  # a last step padded past the end of the stream
                at = StreamPosition(end, at.per_epoch)
            return {"world_size": world_size, "stream": at.to_json()}

        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps the torch optimizer
        scaler = getattr(optimizer, "scaler", None)
        return {
            "model": model,
            "optimizer": inner if inner is not None else Stash(dict),
            "scheduler": scheduler if scheduler is not None else Stash(dict),
            "scaler": (Adapter(scaler.state_dict, scaler.load_state_dict) if scaler is not None else Stash(dict)),
            "trainer_state": (
                Adapter(lambda: json.dumps(dataclasses.asdict(trainer_state), sort_keys=True), lambda v: None)
                if trainer_state is not None
                else Stash(str)
            ),
            "rng": RankLocal(Adapter(rng_state, lambda v: None) if trainer_state is not None else Stash(dict)),
            "world": Adapter(job, lambda v: None) if trainer_state is not None else Stash(dict),
        }

    # ---------------------------------------------------------------- set-up
    def on_init_end(self, args, state, control, model=None, **kwargs):
        check_fsdp_args(args)
        check_tiers_reachable(self.tiers, "FtkitCallback")
        self._model = model
        self._args = args

    def resume_from_checkpoint(self) -> str | None:
        """Load the newest ftkit snapshot; return the directory to pass to ``Trainer.train``.

        Returns ``None`` when the tiers hold no snapshot (a fresh start). The model's
        weights are restored in place now; the rest when training begins.
        """
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
        self._resume["rng"] = rng.take() if rng.has_value else None  # None: a rank the snapshot did not have
        path = self.resume_dir or os.path.join(self._args.output_dir, "ftkit-resume")
        plugin = fsdp_plugin()
        self._fsdp = plugin is not None
        if self._fsdp:
            # The optimizer goes into the live sharded one at on_train_begin (a second restore,
            # of this step): the full copy loaded here is dropped.
            self._resume["optimizer"] = self._resume["scheduler"] = self._resume["scaler"] = None
        path = write_resume_dir(
            self._model, path, self._resume["trainer_state"], self._args.world_size, self._args.process_index, plugin
        )
        self._resume_path = path
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
            found = {url: steps for url, steps in check_tiers_reachable(self.tiers, "FtkitCallback").items() if steps}
            if found:
                url, steps = next(iter(found.items()))
                raise FtkitError(
                    f"ftkit tier {url} holds snapshots up to step {max(steps)}; resume with "
                    "trainer.train(resume_from_checkpoint=ftkit_cb.resume_from_checkpoint()), or "
                    "pass FtkitCallback(..., ignore_existing=True) to start over"
                )
        self._follow_stream(args, state, resume, kwargs.get("train_dataloader"))
        self.checkpointer = Checkpointer(
            self._entries(model, optimizer, lr_scheduler, state, args.world_size),
            self.tiers,
            policy=self.policy,
            rng=False,
            **self.checkpointer_kwargs,
        )
        if resume is not None and self._fsdp:
            self._restore_sharded(resume["step"], args)
        if not self._atexit:  # no exception hook in the Trainer: flush at exit at the latest
            atexit.register(_close_at_exit, weakref.ref(self))
            self._atexit = True

    def _follow_stream(self, args, state, resume: dict[str, Any] | None, loader) -> None:
        """How the Trainer's loader reads the sample stream (_hf_stream.py): from its beginning
        on a fresh start; after a resume, from the snapshot's place in it, on whatever number
        of ranks, or (saying why) where the Trainer's own arithmetic puts it."""
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
        """Under FSDP2: the same step again, into the live sharded model and optimizer (each rank
        reads its own shards; the scheduler and scaler come with it). The model's weights are
        already the step's (the Trainer loaded them from the resume directory); the optimizer's
        state exists only now. The restore's vote means every rank is past the Trainer's load,
        so rank 0 can remove the shared resume directory after it."""
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

    # ------------------------------------------------------------ snapshots
    def on_step_begin(self, args, state, control, **kwargs):
        if self._rng_due is not None:
            rng, self._rng_due = self._rng_due, None
            set_rng_state(rng)
        self._maybe_snapshot(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if stream_ended(self._stop_at, state.global_step):  # a continued stream's planned epochs are done
            control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        try:
            self._maybe_snapshot(state.global_step)
        finally:
            self.close()  # flushes; a failed background persist is raised here

    def _maybe_snapshot(self, step: int) -> None:
        if step <= 0 or step == self._last_step or step % self.every_n_steps or self.checkpointer is None:
            return
        self._last_step = step
        self.checkpointer.snapshot(step)

    # ----------------------------------------------------------------- close
    def __enter__(self) -> FtkitCallback:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Close; when ``train()`` raised, as the Checkpointer's own ``with`` block ends on an
        exception (peers hear of the failure at once; under torchrun a worker whose teardown
        then blocks on a dead peer is ended, so the agent restarts the group)."""
        ck, self.checkpointer = self.checkpointer, None
        if ck is not None:
            ck.__exit__(exc_type, exc, tb)

    def close(self) -> None:
        """Flush pending snapshots and release the staging buffers; re-raise a background failure."""
        ck, self.checkpointer = self.checkpointer, None
        if ck is not None:
            ck.close()

    def _close_quietly(self) -> None:
        try:
            self.close()
        except Exception:
            log.exception("ftkit: error while closing the checkpointer")

    def _remove_resume_dir(self) -> None:
        path, self._resume_path = self._resume_path, None
        if path and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


def _close_at_exit(ref: weakref.ref[FtkitCallback]) -> None:
    cb = ref()
    if cb is not None:
        cb._close_quietly()
