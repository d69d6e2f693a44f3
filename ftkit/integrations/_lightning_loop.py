"""What FtkitCallback does inside Lightning's fit loop: its data fetcher, its samplers, the
SIGTERM handler it installs. Private attributes of Lightning 2.6 (``fit_loop._combined_loader``,
``fit_loop._data_fetcher``, ``trainer._signal_connector``) are read here and nowhere else."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from ftkit.errors import FtkitError
from ftkit.integrations.sampler import ResumableDistributedSampler

log = logging.getLogger("ftkit.lightning")


def drop_batches(fetcher: Any, n: int) -> None:
    """Consume `n` batches without counting them as fetched (the epoch loop counts restored ones)."""
    it = fetcher.iterator
    buffered = getattr(fetcher, "batches", None)  # _PrefetchDataFetcher when the length is unknown
    for _ in range(n):
        if buffered:
            buffered.pop(0)
            try:
                buffered.append(next(it))
            except StopIteration:
                fetcher.done = not buffered
        else:
            try:
                next(it)
            except StopIteration:
                fetcher.done = True
                return


def leave_sigterm_to_ftkit(trainer: Any) -> None:
    """Take Lightning's SIGTERM notifier out of its handler; ftkit's, chained to it, preempts.

    The notifier calls ``dist.broadcast`` inside the signal handler, wherever the main thread
    was interrupted (in another collective, say): with several ranks they deadlock."""
    import signal

    connector = getattr(trainer, "_signal_connector", None)
    handler = signal.getsignal(signal.SIGTERM)
    handlers = getattr(handler, "signal_handlers", None)
    notifier = getattr(connector, "_sigterm_notifier_fn", None)
    if notifier is None or not isinstance(handlers, list) or notifier not in handlers:
        return
    handlers.remove(notifier)
    log.debug("ftkit: Lightning's SIGTERM notifier removed; ftkit handles preemption")


def slurm_requeue_signal(trainer: Any) -> int | None:
    """The signal Lightning's SLURM auto-requeue uses, or None. ftkit takes it (its handler is
    installed first, so Lightning installs none): Lightning's would save from inside the handler."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    env = getattr(trainer.strategy, "cluster_environment", None)
    if env is None:
        env = getattr(getattr(trainer, "_accelerator_connector", None), "cluster_environment", None)
    if not isinstance(env, SLURMEnvironment) or not env.auto_requeue or env.requeue_signal is None:
        return None
    return int(env.requeue_signal)


def _samplers(fit_loop: Any) -> Iterator[tuple[Any, Any]]:
    """(loader, sampler) for the sampler and the batch sampler's sampler of each training loader."""
    loaders = fit_loop._combined_loader
    for dl in loaders.flattened if loaders is not None else []:
        for s in (getattr(dl, "sampler", None), getattr(getattr(dl, "batch_sampler", None), "sampler", None)):
            yield dl, s


def drop_stateless_batches(fit_loop: Any, n: int) -> None:
    """Consume `n` batches of each training loader without a state of its own (Lightning's duck-typed
    _Stateful), beside stateful ones that resume from theirs: Lightning restores only those."""
    loaders = fit_loop._combined_loader
    for dl, it in zip(loaders.flattened, loaders._iterator.iterators):
        if not (hasattr(dl, "state_dict") and hasattr(dl, "load_state_dict")):
            for _ in range(n):
                next(it, None)


def load_loader_states(fit_loop: Any, states: list[Any]) -> None:
    """Load the stateful training loaders' saved state_dict()s, as FitLoop.setup_data does, for the next iterator."""
    fit_loop._combined_loader._load_state_dicts(states)


def set_sampler_epoch(fit_loop: Any, epoch: int) -> None:
    """Set every training sampler's epoch, as the fit loop does only after the callback re-makes the iterator."""
    for _, s in _samplers(fit_loop):
        set_epoch = getattr(s, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


def fit_epoch_length(trainer: Any, done: int) -> None:
    """Fit the epoch loop's batch count, `done` already counted, to what a ResumableDistributedSampler has left."""
    fit_loop = trainer.fit_loop
    loaders = fit_loop._combined_loader
    if loaders is None or trainer.limit_train_batches != 1.0:  # a user limit: Lightning's count stands
        return
    left: list[int | float] = [len(dl) for dl in loaders.flattened]
    loaders.limits = left
    fit_loop.max_batches = done + max(left)


def resumable_sampler(trainer: Any) -> ResumableDistributedSampler | None:
    """The training loader's ResumableDistributedSampler, if it has one (it must be the only loader)."""
    found: dict[int, ResumableDistributedSampler] = {}
    for dl, s in _samplers(trainer.fit_loop):
        inner = getattr(s, "dataset", None)  # Lightning's DistributedSamplerWrapper holds the user's
        if isinstance(getattr(inner, "_sampler", None), ResumableDistributedSampler):
            raise FtkitError(
                "Lightning wrapped the ResumableDistributedSampler in a DistributedSampler: "
                "give the Trainer use_distributed_sampler=False"
            )
        if isinstance(s, ResumableDistributedSampler):
            found.setdefault(id(dl), s)  # one per loader, whichever of its two places holds it
    if len(found) > 1:
        raise FtkitError("FtkitCallback follows one ResumableDistributedSampler; the training loaders have several")
    return next(iter(found.values()), None)
