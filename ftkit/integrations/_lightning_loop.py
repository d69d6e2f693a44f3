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
    """Consume `n` batches from the fetcher's iterator without counting them as fetched:
    the epoch loop adds the restored batch count to `fetcher.fetched` itself."""
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
    """Take Lightning's SIGTERM notifier out of the SIGTERM handler it installs at fit start.

    With several ranks it calls ``dist.broadcast`` from inside the signal handler, wherever
    the main thread was interrupted (in another collective, or on a rank its peers are not
    waiting for): the ranks deadlock, and the preemption deadline ends the job without a
    final save. ftkit's handler, which Lightning's chains to, does the preemption instead:
    ranks agree on a step through the store, save it to every tier, and exit with 128 + the
    signal, so the scheduler or torchrun restarts the job from it. Other handlers stay."""
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
    """The signal Lightning's SLURM environment requeues the job on (``SLURMEnvironment(
    auto_requeue=True)``, the default when the job runs under SLURM: SIGUSR1 unless
    ``requeue_signal`` says otherwise), or None when the job is not requeued on a signal.

    Lightning's own handler for it saves a checkpoint from inside the signal handler
    (collectives, under DDP, wherever the main thread was interrupted) and then requeues;
    ftkit takes the signal instead (its handler is installed first, so Lightning installs
    none): ranks agree on a step, save it to every tier, and rank 0 requeues."""
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


def set_sampler_epoch(fit_loop: Any, epoch: int) -> None:
    """What Lightning's fit loop does at each epoch's start (a DistributedSampler's shuffle is
    seeded with its epoch), for the iterator the callback re-makes before that."""
    for _, s in _samplers(fit_loop):
        set_epoch = getattr(s, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)


def fit_epoch_length(trainer: Any, done: int) -> None:
    """With a ResumableDistributedSampler an epoch's length is what the sampler has left
    (after a resume on another world size, or a last round carried into the next epoch):
    make the epoch loop's batch count agree, `done` batches already counted."""
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
