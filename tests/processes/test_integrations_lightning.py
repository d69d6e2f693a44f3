"""ftkit.integrations.lightning with a real Lightning Trainer on CPU.

An uninterrupted fit is compared bit for bit with a fit that is killed (SIGKILL, in a
child process) or fails (an exception) part way, then resumed by a new Trainer: model
weights, optimizer state, scheduler state, the batches each step saw, epoch and
global_step. No mocks: real Trainer, real DataLoader (shuffling), real ftkit tiers.

Run as a script (``python tests/processes/test_integrations_lightning.py CKPT KILL_AT EVERY``)
it is the child that trains and SIGKILLs itself.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import signal
import socket
import subprocess
import sys
import warnings

import pytest
import torch

if importlib.util.find_spec("lightning") is None:  # a missing extra fails the tests, it does not skip them
    pytest.fail("lightning is not installed: pip install -e '.[test]' (the 'lightning' extra)", pytrace=False)

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

import ftkit  # noqa: E402
from ftkit.format.reader import committed_steps  # noqa: E402
from ftkit.integrations.lightning import FtkitCallback  # noqa: E402

HERE = os.path.abspath(__file__)
BATCHES_PER_EPOCH = 10  # 40 samples, batch size 4
EPOCHS = 3


class Net(pl.LightningModule):
    """Dropout (RNG), AdamW (state), a scheduler (state), shuffled data (sampler RNG)."""

    def __init__(
        self,
        width: int = 16,
        interval: str = "step",
        validate: bool = False,
        iterable: bool = False,
        stateful: str | None = None,
    ):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(width, 1)
        )
        self.interval = interval
        self.validate = validate
        self.iterable = iterable
        # a torchdata StatefulDataLoader: "shuffle", "shuffle-workers", its sampler, or "mixed" (beside a DataLoader)
        self.stateful = stateful

    def training_step(self, batch, batch_idx):
        return sum((self.net(x) - y).pow(2).mean() for x, y in batches(batch))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", (self.net(x) - y).pow(2).mean())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": self.interval}}

    @staticmethod
    def dataset():
        g = torch.Generator().manual_seed(123)
        return TensorDataset(torch.randn(40, 8, generator=g), torch.randn(40, 1, generator=g))

    def train_dataloader(self):
        if self.iterable:  # no len(): Lightning prefetches to find the epoch's end
            return DataLoader(Stream(self.dataset()), batch_size=4, num_workers=0)
        if self.stateful:  # Lightning saves and loads its state_dict() with the loops'
            from torchdata.stateful_dataloader import StatefulDataLoader

            ds = self.dataset()
            samplers = {"distributed": DistributedSampler, "resumable": ftkit.ResumableDistributedSampler}
            sampler = samplers[self.stateful](ds, num_replicas=1, rank=0) if self.stateful in samplers else None
            workers = 2 if self.stateful == "shuffle-workers" else 0
            loader = StatefulDataLoader(ds, batch_size=4, shuffle=sampler is None, sampler=sampler, num_workers=workers)
            if self.stateful == "mixed":  # a CombinedLoader of a stateful loader and a plain one
                return {"a": loader, "b": DataLoader(ds, batch_size=4, shuffle=True)}
            return loader
        return DataLoader(self.dataset(), batch_size=4, shuffle=True, num_workers=0)

    def val_dataloader(self):
        return DataLoader(self.dataset(), batch_size=8) if self.validate else []


def batches(batch) -> list:
    """The (x, y) of each training loader in a step's batch."""
    return list(batch.values()) if isinstance(batch, dict) else [batch]


class Stream(torch.utils.data.IterableDataset):
    """The same samples without a length, in an order drawn from the global RNG each epoch."""

    def __init__(self, ds):
        self.ds = ds

    def __iter__(self):
        for i in torch.randperm(len(self.ds)).tolist():
            yield self.ds[i]


class Trace(pl.Callback):
    """What each training step saw: (epoch, batch_idx, global_step before it, digest of the batch)."""

    def __init__(self):
        self.steps: list[tuple] = []
        self.at_start: tuple | None = None

    def on_train_start(self, trainer, pl_module):
        self.at_start = (trainer.current_epoch, trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        digest = hashlib.sha1(b"".join(t.numpy().tobytes() for b in batches(batch) for t in b)).hexdigest()[:12]
        self.steps.append((trainer.current_epoch, batch_idx, trainer.global_step, digest))


class FailAt(pl.Callback):
    def __init__(self, step: int, kill: bool = False, flush: FtkitCallback | None = None):
        self.step, self.kill, self.flush = step, kill, flush

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        if self.kill:
            if self.flush is not None:  # make "which step is newest" deterministic for the test
                self.flush.checkpointer.wait()
            os.kill(os.getpid(), signal.SIGKILL)  # no finally, no close, no flush: a crash
        raise RuntimeError(f"injected failure at step {self.step}")


def fit(
    ckpt: str | None,
    *,
    every: int = 1,
    fail_at: int | None = None,
    kill: bool = False,
    width: int = 16,
    interval: str = "step",
    validate: bool = False,
    iterable: bool = False,
    stateful: str | None = None,
    ftkit_tiers=None,
    restore: bool = True,
    epochs: int = EPOCHS,
    ckpt_path: str | None = None,
):
    pl.seed_everything(0, verbose=False)
    model = Net(width, interval, validate, iterable, stateful)
    trace = Trace()
    ftcb = None
    if ckpt or ftkit_tiers:
        ftcb = FtkitCallback(ftkit_tiers or [ckpt], every_n_steps=every, restore=restore)
    callbacks = ([ftcb] if ftcb else []) + [trace]
    if fail_at is not None:
        callbacks.append(FailAt(fail_at, kill=kill, flush=ftcb))
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=2 if validate else 0,
        callbacks=callbacks,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on num_workers etc.
        trainer.fit(model, ckpt_path=ckpt_path)
    return model, trainer, trace, ftcb


def final_values(model, trainer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for pid, st in trainer.optimizers[0].state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim/{pid}/{k}"] = v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"differ: {differ}"


@pytest.fixture(autouse=True)
def _restore_global_torch_flags():
    """Trainer(deterministic=True) and seed_everything change process-wide settings."""
    det = torch.are_deterministic_algorithms_enabled()
    env = {k: os.environ.get(k) for k in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "CUBLAS_WORKSPACE_CONFIG")}
    yield
    torch.use_deterministic_algorithms(det)
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def reference():
    """The uninterrupted runs the others must equal, one per configuration."""
    cache: dict[tuple, tuple] = {}

    def get(interval: str = "step", validate: bool = False, iterable: bool = False, stateful: str | None = None):
        key = (interval, validate, iterable, stateful)
        if key not in cache:
            model, trainer, trace, _ = fit(
                None, interval=interval, validate=validate, iterable=iterable, stateful=stateful
            )
            assert trainer.global_step == EPOCHS * BATCHES_PER_EPOCH and trainer.current_epoch == EPOCHS
            cache[key] = (
                final_values(model, trainer),
                trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                trace.steps,
            )
        return cache[key]

    return get


def test_sigkill_mid_epoch_then_resume_equals_uninterrupted_run(tmp_path, reference):
    ckpt = str(tmp_path / "ckpt")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, HERE, ckpt, "13", "3"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    assert committed_steps(ftkit.Tier(ckpt).open()) == [9, 12]  # keep=2; 13 is not a multiple of 3

    model, trainer, trace, ftcb = fit(ckpt, every=3)
    assert ftcb.restored_step == 12
    assert trace.at_start == (1, 12)  # epoch 1, 12 optimizer steps done
    assert trace.steps[0] == (1, 2, 12, trace.steps[0][3])  # continues at the 3rd batch of epoch 1
    assert trainer.global_step == EPOCHS * BATCHES_PER_EPOCH and trainer.current_epoch == EPOCHS
    ref_values, ref_sched, ref_steps = reference()
    assert trace.steps == ref_steps[12:]  # the same batches, in the same order, at the same steps
    assert_bitwise_equal(final_values(model, trainer), ref_values)
    assert trainer.lr_scheduler_configs[0].scheduler.state_dict() == ref_sched
    assert committed_steps(ftkit.Tier(ckpt).open()) == [27, 30]


@pytest.mark.parametrize("validate", [False, True], ids=["no-val", "val"])
def test_exception_at_epoch_end_then_resume_equals_uninterrupted_run(tmp_path, reference, validate):
    """The snapshot is of the epoch's last batch (Lightning restarts into the next epoch); the
    scheduler steps per epoch; the exception path must flush the snapshot (on_exception)."""
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="injected failure at step 10"):
        fit(ckpt, every=5, fail_at=10, interval="epoch", validate=validate)
    assert committed_steps(ftkit.Tier(ckpt).open()) == [5, 10]

    model, trainer, trace, ftcb = fit(ckpt, every=5, interval="epoch", validate=validate)
    assert ftcb.restored_step == 10
    assert trace.steps[0][:3] == (1, 0, 10)
    assert trainer.global_step == EPOCHS * BATCHES_PER_EPOCH and trainer.current_epoch == EPOCHS
    ref_values, ref_sched, ref_steps = reference("epoch", validate)
    assert trace.steps == ref_steps[10:]
    assert_bitwise_equal(final_values(model, trainer), ref_values)
    assert trainer.lr_scheduler_configs[0].scheduler.state_dict() == ref_sched


@pytest.mark.parametrize("fail_at,every", [(13, 3), (10, 5)], ids=["mid-epoch", "epoch-end"])
def test_iterable_dataset_without_length_resumes_exactly(tmp_path, reference, fail_at, every):
    steps, ref_steps = _fail_and_resume(tmp_path, reference, fail_at, every, iterable=True)
    # Without a length, Lightning's own restart at an epoch end keeps counting batch_idx
    # from the previous epoch (as it does for its own checkpoints): compare the rest.
    assert [(e, g, d) for e, _, g, d in steps] == [(e, g, d) for e, _, g, d in ref_steps]


def _fail_and_resume(tmp_path, reference, fail_at: int, every: int, **data):
    """Fail at `fail_at`, resume to the end, check the restored step, the end and the final
    values against the uninterrupted run's; (the resumed run's steps, the reference's from there)."""
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(RuntimeError, match="injected failure"):
        fit(ckpt, every=every, fail_at=fail_at, **data)
    model, trainer, trace, ftcb = fit(ckpt, every=every, **data)
    resumed = fail_at - fail_at % every
    assert ftcb.restored_step == resumed
    assert trainer.global_step == EPOCHS * BATCHES_PER_EPOCH and trainer.current_epoch == EPOCHS
    ref_values, _, ref_steps = reference(**data)
    assert_bitwise_equal(final_values(model, trainer), ref_values)
    return trace.steps, ref_steps[resumed:]


@pytest.mark.parametrize(
    "loader,fail_at,every",
    [
        ("shuffle", 13, 3),
        ("shuffle-workers", 23, 3),
        ("shuffle", 10, 5),
        ("distributed", 13, 3),
        ("resumable", 13, 3),
        ("mixed", 13, 3),
    ],
    ids=[
        "mid-epoch",
        "2-workers-mid-epoch",
        "epoch-end",
        "distributed-sampler",
        "resumable-sampler",
        "with-a-plain-loader",
    ],
)
def test_stateful_dataloader_resumes_exactly(tmp_path, reference, loader, fail_at, every):
    """torchdata's StatefulDataLoader, whose state_dict() Lightning keeps with the loops': its own
    RandomSampler draws each epoch from a generator of its own, which only that state holds; a
    DistributedSampler's epoch must be set before the iterator is made from it; the
    ResumableDistributedSampler's position, in that state too, must not be skipped past twice."""
    steps, ref_steps = _fail_and_resume(tmp_path, reference, fail_at, every, stateful=loader)
    assert steps == ref_steps


def test_snapshot_of_a_different_model_fails_restore_naming_keys(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(RuntimeError):
        fit(ckpt, every=5, fail_at=5)  # leaves step 5 of a width-16 model
    pl.seed_everything(1, verbose=False)
    other = Net(width=32)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    trainer = pl.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=1,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[FtkitCallback([ckpt])],
    )
    with pytest.raises(ftkit.StateMismatchError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(other)
    msg = str(err.value)
    assert "model/net.0.weight: shape (16, 8) in checkpoint, (32, 8) live" in msg
    assert "model/net.3.weight" in msg
    assert trainer.global_step == 0
    assert_bitwise_equal({k: v for k, v in other.state_dict().items()}, before)  # untouched


def test_unreachable_tier_fails_at_setup_before_any_step(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tier = ftkit.Tier(
        "s3://bucket/run",
        storage_options={
            "key": "AKIDEXAMPLE",
            "secret": "not-a-real-secret-123",
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"},
        },
    )
    with pytest.raises(ftkit.StorageError) as err:
        fit(None, ftkit_tiers=[str(tmp_path / "local"), tier])
    msg = str(err.value)
    assert "FtkitCallback: checkpoint tier s3://bucket/run cannot be used" in msg
    assert "Could not connect" in msg and "not-a-real-secret-123" not in msg
    assert not (tmp_path / "local").exists()  # nothing was trained or written


def test_a_file_in_place_of_the_tier_directory_fails_at_setup(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ftkit.StorageError, match="cannot be used"):
        fit(str(blocker / "ckpt"))


def _child(ckpt: str, kill_at: int, every: int) -> None:
    warnings.simplefilter("ignore")
    fit(ckpt, every=every, fail_at=kill_at, kill=True)
    raise SystemExit("the child should have been killed")


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))


def test_starting_over_retires_the_earlier_runs_snapshots(tmp_path):
    """restore=False over a finished run's tier: the new run's snapshots are kept (the old
    run's steps of the same numbers refused them), and a restart after its failure resumes the
    new run, not the old run's newer steps."""
    ckpt = str(tmp_path / "ckpt")
    fit(ckpt, every=5)
    assert committed_steps(ftkit.Tier(ckpt).open())[-1] == EPOCHS * BATCHES_PER_EPOCH
    with pytest.raises(RuntimeError, match="injected failure at step 10"):
        fit(ckpt, every=5, fail_at=10, interval="epoch", restore=False)
    assert committed_steps(ftkit.Tier(ckpt).open()) == [5, 10]  # the new run's; the old run's newer ones retired
    model, trainer, trace, ftcb = fit(ckpt, every=5, interval="epoch")
    assert ftcb.restored_step == 10 and trainer.global_step == EPOCHS * BATCHES_PER_EPOCH


def test_state_kept_through_checkpoint_hooks_is_named_in_a_warning(tmp_path, monkeypatch, caplog):
    """ftkit snapshots state_dict()s: a module keeping state through on_save_checkpoint would
    restart it after a restore, so the callback says so, naming the module."""
    monkeypatch.setattr(Net, "on_save_checkpoint", lambda self, checkpoint: checkpoint.update(seen=1), raising=False)
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        fit(str(tmp_path / "ckpt"), every=5)
    said = [r.getMessage() for r in caplog.records if "on_save_checkpoint/on_load_checkpoint" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("ftkit: Net keep(s) state"), said
    caplog.clear()
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger="ftkit"):
        fit(str(tmp_path / "ckpt2"), every=5)
    assert not [r for r in caplog.records if "on_save_checkpoint" in r.getMessage()]


def test_a_fit_from_lightnings_own_checkpoint_retires_the_tiers_newer_steps(tmp_path):
    """fit(ckpt_path=...) of a step-10 Lightning checkpoint over a tier that holds another run's
    steps 25 and 30 (a wider model): the run's own snapshots 15-30 are kept, so a restart
    restores its step 30, not the other run's."""
    ckpt = str(tmp_path / "ckpt")
    fit(ckpt, every=5, width=32)
    assert committed_steps(ftkit.Tier(ckpt).open()) == [25, 30]
    _, trainer, _, _ = fit(None, epochs=1)
    trainer.save_checkpoint(str(tmp_path / "ten.ckpt"))
    model, trainer, trace, ftcb = fit(ckpt, every=5, ckpt_path=str(tmp_path / "ten.ckpt"))
    assert trace.steps[0][2] == 10 and trainer.global_step == EPOCHS * BATCHES_PER_EPOCH
    assert committed_steps(ftkit.Tier(ckpt).open()) == [25, 30]  # this run's now
    trained = final_values(model, trainer)
    model, trainer, _, ftcb = fit(ckpt, every=5)
    assert ftcb.restored_step == 30
    assert_bitwise_equal(final_values(model, trainer), trained)
