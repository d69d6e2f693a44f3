"""PyTorch Lightning: snapshot a ``Trainer`` into ftkit tiers and resume it exactly.

::

    from ftkit.integrations.lightning import FtkitCallback

    trainer = L.Trainer(max_epochs=10, callbacks=[FtkitCallback(["/local/ckpt"], every_n_steps=50)])
    trainer.fit(model)      # resumes from the newest ftkit snapshot, if there is one

A snapshot (``on_train_batch_end``, where ``ModelCheckpoint(every_n_train_steps=...)`` saves)
holds what ``_state`` lists; the loops restart as on Lightning's ``ckpt_path=`` resume, which
wins over ftkit. Lightning starts a plain DataLoader over on a mid-epoch resume; the callback
re-makes the epoch's iterator from its epoch-start RNG state and drops the batches already
consumed, or, for a loader with a ``state_dict`` (torchdata's StatefulDataLoader), from that.
Several ranks, samplers and tests: docs/integrations.md.

Limits: a ``training_step`` taking ``dataloader_iter`` resumes without the fast-forward (with
a warning); ``persistent_workers=True`` keeps worker RNG state no checkpoint holds; random
draws in ``on_train_epoch_start`` make the resumed permutation differ.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

try:  # the unified package first, then the standalone one
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        import pytorch_lightning as pl
        from pytorch_lightning.callbacks import Callback
    except ImportError:
        raise ImportError(
            "ftkit.integrations.lightning needs PyTorch Lightning: "
            "pip install 'ftkit[lightning]' (or lightning / pytorch-lightning >= 2.2)"
        ) from None

from ftkit.checkpointer import Checkpointer
from ftkit.config import Tier
from ftkit.errors import FtkitError
from ftkit.integrations._common import Adapter, CallbackBase, Stash, check_tiers_reachable
from ftkit.integrations._lightning_loop import (
    drop_batches,
    drop_stateless_batches,
    fit_epoch_length,
    leave_sigterm_to_ftkit,
    load_loader_states,
    resumable_sampler,
    set_sampler_epoch,
    slurm_requeue_signal,
)
from ftkit.integrations.sampler import ResumableDistributedSampler
from ftkit.save.capture import RankLocal
from ftkit.save.rng import rng_state, set_rng_state

log = logging.getLogger("ftkit.lightning")

__all__ = ["FtkitCallback"]

_ENTRY = "ftkit_lightning"  # the job's: world size, the resumable sampler's position
_RANK_ENTRY = "ftkit_lightning_rank"  # each rank's: its RNG states


class FtkitCallback(CallbackBase, Callback):
    """Snapshot the Lightning training state into ftkit tiers, and resume from the newest one.

    tiers: ftkit tiers (``Tier`` objects, URLs or dicts); opened in ``setup``, before the first batch.
    every_n_steps: snapshot when ``trainer.global_step`` (optimizer steps) is a multiple of this
        (a tier's ``every`` applies on top).
    policy: ``"wait"`` or ``"skip"`` when both staging buffers are busy (see ``Checkpointer``).
    restore: resume from the newest snapshot at fit start; ``False`` starts over.
    checkpointer_kwargs: passed to :class:`ftkit.Checkpointer` (``max_staging_bytes``, ``rng``).
    """

    def __init__(
        self,
        tiers: Sequence[Tier | str | dict] | Tier | str,
        every_n_steps: int = 1,
        *,
        policy: str = "wait",
        restore: bool = True,
        **checkpointer_kwargs: Any,
    ):
        super().__init__(tiers, every_n_steps, policy)
        self.restore = restore
        self.rng = bool(checkpointer_kwargs.pop("rng", True))
        self.checkpointer_kwargs = checkpointer_kwargs
        self._epoch_rng: dict[str, Any] | None = None
        # What a restore loaded, made anew by _state at each fit: the job entry (world size, sampler
        # position) and this rank's RNG states, for on_train_start to apply.
        self._job = self._own = Stash(dict)
        self._sampler: ResumableDistributedSampler | None = None  # the training loader's, if it has one
        self._loader_states: list[Any] = []  # the training loaders' own, as restored (StatefulDataLoader's)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            check_tiers_reachable(self.tiers, "FtkitCallback")

    def _state(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        state: dict[str, Any] = {"model": pl_module}
        for i, opt in enumerate(trainer.optimizers):
            state[f"optimizer{i}"] = opt
        for i, cfg in enumerate(trainer.lr_scheduler_configs):
            state[f"scheduler{i}"] = cfg.scheduler
        prec = trainer.precision_plugin
        state["precision"] = Adapter(prec.state_dict, lambda sd: prec.load_state_dict(sd) if sd else None)
        state["callbacks"] = Adapter(
            lambda: self._callback_states(trainer), lambda sd: self._load_callback_states(trainer, sd)
        )
        dm = trainer.datamodule  # (Lightning sets it on the trainer at fit)
        if dm is not None:
            state["datamodule"] = Adapter(dm.state_dict, lambda sd: dm.load_state_dict(sd) if sd else None)
        state["loops"] = Adapter(trainer.fit_loop.state_dict, lambda sd: self._load_loops(trainer, sd))
        state[_ENTRY] = self._job = Stash(lambda: self._job_state(trainer))
        self._own = Stash(self._own_state)
        state[_RANK_ENTRY] = RankLocal(self._own)
        return state

    def _job_state(self, trainer: pl.Trainer) -> dict[str, Any]:
        sampler = self._sampler
        return {"world_size": trainer.world_size, "sampler": sampler.state_dict() if sampler is not None else None}

    def _callback_states(self, trainer: pl.Trainer) -> dict[str, Any]:
        # (trainer.callbacks: a Trainer property Lightning adds)
        return {str(cb.state_key): sd for cb in trainer.callbacks if cb is not self and (sd := cb.state_dict())}

    def _load_callback_states(self, trainer: pl.Trainer, saved: dict[str, Any]) -> None:
        for cb in trainer.callbacks:
            if cb is not self and str(cb.state_key) in saved:
                cb.load_state_dict(saved[str(cb.state_key)])

    def _load_loops(self, trainer: pl.Trainer, sd: dict[str, Any]) -> None:
        trainer.fit_loop.load_state_dict(sd)
        # The stateful loaders' state_dict()s, saved with the loops as Lightning does: on_train_start loads them again
        self._loader_states = sd.get("state_dict", {}).get("combined_loader") or []
        max_epochs = trainer.max_epochs
        if max_epochs not in (None, -1) and trainer.current_epoch > max_epochs:
            raise FtkitError(f"the snapshot is at epoch {trainer.current_epoch}, past Trainer(max_epochs={max_epochs})")

    def _own_state(self) -> dict[str, Any]:
        return {"rng": rng_state(), "epoch_rng": self._epoch_rng} if self.rng else {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _warn_of_checkpoint_hooks(trainer, pl_module, self)
        self._close_quietly()
        self._last_step = -1
        self._sampler = None
        self.restored_step = 0
        kwargs = dict(self.checkpointer_kwargs)
        requeue_on = slurm_requeue_signal(trainer)
        if requeue_on is not None and "requeue_signals" not in kwargs:  # SLURM auto-requeue: ftkit's to do
            kwargs["requeue_signals"] = (requeue_on,)
            log.info(
                "ftkit: SLURM auto-requeue: on signal %d the agreed step is saved, then the job requeued", requeue_on
            )
        self.checkpointer = Checkpointer(
            self._state(trainer, pl_module), self.tiers, policy=self.policy, rng=False, **kwargs
        )
        if self.restore and trainer.ckpt_path:
            log.warning(
                "trainer.fit(ckpt_path=%s) given: Lightning restores that checkpoint; ftkit does not restore",
                trainer.ckpt_path,
            )
        elif self.restore and trainer.global_step > 0:
            log.info(
                "ftkit: this Trainer has already trained %d steps; continuing without a restore", trainer.global_step
            )
        elif self.restore:
            self.restored_step = self.checkpointer.restore()
        if self.restored_step:
            self._last_step = trainer.global_step
            pending: dict[str, Any] = self._own.loaded or {}
            if self.rng and pending.get("rng") is not None:
                set_rng_state(pending["rng"])
            self._epoch_rng = pending.get("epoch_rng")
            log.info(
                "ftkit: resumed from step %d (epoch %d, global_step %d)",
                self.restored_step,
                trainer.current_epoch,
                trainer.global_step,
            )
        else:
            # The first epoch's iterator is made right after this hook (FitLoop.setup_data).
            self._epoch_rng = rng_state() if self.rng else None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.restored_step and self.checkpointer is not None:
            # Started over, or from Lightning's own checkpoint (loaded by now, so its step is known):
            # the tiers' newer steps, an earlier run's, go at the first snapshot.
            self.checkpointer.continue_from(trainer.global_step)
        if trainer.world_size > 1:
            leave_sigterm_to_ftkit(trainer)
        self._sampler = resumable_sampler(trainer)
        pending = self._own.take() or {}  # {}: a rank the snapshot has no state for (a grown world)
        job = self._job.take() or {}
        loader_states, self._loader_states = self._loader_states, []
        if not self.restored_step:
            return
        if self._sampler is not None:
            saved = job.get("sampler")
            if saved is None:
                raise FtkitError(
                    "the snapshot holds no ResumableDistributedSampler position but the training loader has that "
                    "sampler: the snapshot was taken with another one"
                )
            self._sampler.load_state_dict(saved)  # the job's position: the same on every rank
        elif job.get("world_size", trainer.world_size) != trainer.world_size:
            log.warning(
                "ftkit: resumed on %d ranks from a snapshot of %d: the sampler's shards differ, so the interrupted "
                "epoch's sample stream does not continue exactly (use ftkit.ResumableDistributedSampler and "
                "Trainer(use_distributed_sampler=False) for that)",
                trainer.world_size,
                job["world_size"],
            )
        fit_loop = trainer.fit_loop
        fetcher = fit_loop._data_fetcher
        progress = fit_loop.epoch_loop.batch_progress
        consumed = progress.current.ready
        if progress.is_last_batch or (self._sampler is None and consumed >= trainer.num_training_batches):
            # The snapshot ended an epoch: the next starts from a fresh iterator and the RNG
            # state the original run made it with.
            consumed = 0
            epoch_rng = self._epoch_rng = pending.get("rng")
        else:
            epoch_rng = pending.get("epoch_rng")
        if fetcher is None or fetcher.iterator is None:
            return
        if type(fetcher).__name__ == "_DataLoaderIterDataFetcher":
            log.warning(
                "ftkit: training_step takes dataloader_iter; the data position of the interrupted epoch is not restored"
            )
            return
        if self._sampler is None:  # Lightning sets the epoch only after this hook: the iterator needs it now
            set_sampler_epoch(fit_loop, trainer.current_epoch)
        elif consumed:  # its iterator starts at the restored position: drop nothing
            fit_epoch_length(trainer, done=consumed)
        else:  # the interrupted epoch had ended: it ends at once, the next starts where the sampler is
            fit_loop.max_batches = progress.current.ready
        if self.rng and epoch_rng is not None:
            set_rng_state(epoch_rng)
        # A stateful loader (StatefulDataLoader) continues from its saved state, loaded again now that the
        # sampler's epoch is set; not with a ResumableDistributedSampler (its position rules), nor without
        # a length (Lightning had fetched a batch ahead of the snapshot's when it took that state).
        from_state = bool(consumed and loader_states and self._sampler is None and fetcher.length is not None)
        if from_state:
            load_loader_states(fit_loop, loader_states)
        iter(fetcher)  # a fresh iterator for this epoch: same sampler permutation, same worker seeds
        drop_batches(fetcher, consumed if self._sampler is None and not from_state else 0)
        if from_state:  # a plain loader beside the stateful ones: its batches are dropped
            drop_stateless_batches(fit_loop, consumed)
        if self._sampler is not None and consumed and fetcher.length is not None:
            # The epoch loop counts the restored batches into `fetched`: the epoch's length counts them too.
            fetcher.length = int(fit_loop.max_batches)
        if consumed and self.rng and pending.get("rng") is not None:
            # Back to the snapshot's RNG state (with nothing dropped, the iterator's lazy first
            # draws still come from the epoch's state, as in the original run).
            set_rng_state(pending["rng"])
        if self._sampler is not None:
            log.info(
                "ftkit: the sampler resumes at epoch %d, position %d of the global stream, on %d rank(s)",
                self._sampler.epoch,
                self._sampler.position,
                self._sampler.num_replicas,
            )
        else:
            how = "resumed from its state_dict" if from_state else "moved"
            log.info("ftkit: dataloader %s past the %d batch(es) this epoch had consumed", how, consumed)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning makes a new iterator for this epoch right after this hook, under the same
        # condition it uses in _TrainingEpochLoop.on_run_start.
        loop = trainer.fit_loop
        if trainer.current_epoch > 0 and not getattr(loop, "is_resuming", False) and not loop.epoch_loop.restarting:
            self._epoch_rng = rng_state() if self.rng else None
            if self._sampler is not None:
                fit_epoch_length(trainer, done=0)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._sampler is not None:  # before this step's snapshot: the position after its batch
            from lightning.pytorch.utilities.data import extract_batch_size

            self._sampler.advance(extract_batch_size(batch))
        self._maybe_snapshot(trainer.global_step)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.close()  # flushes; a failed background persist is raised here

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._close_quietly()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._end_checkpointer(type(exception), exception, exception.__traceback__)


def _warn_of_checkpoint_hooks(trainer: pl.Trainer, pl_module: pl.LightningModule, ours: Callback) -> None:
    """Name the module and callbacks that keep state through on_save_checkpoint /
    on_load_checkpoint: ftkit snapshots state_dict()s, not Lightning's checkpoint dict, so
    that state would restart from scratch after a restore, silently."""
    hooks = ("on_save_checkpoint", "on_load_checkpoint")
    owners = [type(pl_module).__name__] if any(_overrides(pl_module, pl.LightningModule, h) for h in hooks) else []
    owners += [
        type(cb).__name__
        for cb in trainer.callbacks
        if cb is not ours and any(_overrides(cb, Callback, h) for h in hooks)
    ]
    if owners:
        log.warning(
            "ftkit: %s keep(s) state through on_save_checkpoint/on_load_checkpoint, which ftkit's snapshots do "
            "not call (they hold state_dict()s): that state restarts after an ftkit restore. Keep it in the "
            "module's state_dict() (a buffer) or the callback's state_dict()",
            ", ".join(owners),
        )


def _overrides(obj: Any, base: type, name: str) -> bool:
    return getattr(type(obj), name, None) is not getattr(base, name, None)
