"""ftkit.integrations.huggingface with a real transformers.Trainer on CPU.

A tiny GPT-2 built from a local config (no downloads) trains for 3 epochs; a run that is
SIGKILLed in a child process (or fails with an exception) part way, then resumed by a new
Trainer, must end with the same weights and optimizer state bit for bit, have trained on
the same batches at the same steps, and count the same steps. No mocks.

Run as a script (``python tests/processes/test_integrations_huggingface.py OUT CKPT KILL_AT EVERY``)
it is the child that trains and SIGKILLs itself.
"""

from __future__ import annotations

import gc
import hashlib
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import warnings
import weakref

import pytest
import torch

if any(importlib.util.find_spec(m) is None for m in ("transformers", "accelerate")):  # fail, do not skip
    pytest.fail(
        "transformers/accelerate are not installed: pip install -e '.[test]' (the 'huggingface' extra)", pytrace=False
    )

from hfkit import Tokens, make_model  # noqa: E402
from transformers import EarlyStoppingCallback, Trainer, TrainerCallback, TrainingArguments  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import ftkit  # noqa: E402
from ftkit.format.reader import committed_steps  # noqa: E402
from ftkit.integrations.huggingface import FtkitCallback  # noqa: E402

HERE = os.path.abspath(__file__)
SUPPORT = os.path.join(os.path.dirname(os.path.dirname(HERE)), "support")  # hfkit, for HERE run as a script
STEPS_PER_EPOCH = 10  # 40 sequences, batch size 4
EPOCHS = 3


class Trace(TrainerCallback):
    """(global_step before the step, digest of the batch it trained on) for every step."""

    def __init__(self, model):
        self.steps: list[tuple[int, str]] = []
        self.state = None
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if module.training and self.state is not None:
            ids = kwargs["input_ids"]
            self.steps.append((self.state.global_step, hashlib.sha1(ids.numpy().tobytes()).hexdigest()[:12]))

    def on_train_begin(self, args, state, control, **kwargs):
        self.state = state
        self.at_start = (state.global_step, state.epoch)


class FailAt(TrainerCallback):
    def __init__(self, step: int, kill: bool = False, flush: FtkitCallback | None = None):
        self.step, self.kill, self.flush = step, kill, flush

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != self.step:
            return
        if self.kill:
            if self.flush is not None:  # make "which step is newest" deterministic for the test
                self.flush.checkpointer.wait()
            os.kill(os.getpid(), signal.SIGKILL)  # no finally, no close, no flush: a crash
        raise RuntimeError(f"injected failure at step {self.step}")


def make_trainer(
    out: str,
    ckpt: str | None,
    *,
    every: int = 1,
    fail_at: int | None = None,
    kill: bool = False,
    n_embd: int = 32,
    tiers=None,
    resume_dir=None,
    ignore_existing=False,
    callbacks=(),
    eval_dataset=None,
    **extra_args,
):
    model = make_model(n_embd)
    args = TrainingArguments(
        output_dir=out,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        per_device_train_batch_size=4,
        num_train_epochs=EPOCHS,
        learning_rate=1e-3,
        warmup_steps=3,
        logging_steps=5,
        seed=0,
        disable_tqdm=True,
        **extra_args,
    )
    trace = Trace(model)
    ftcb = None
    if ckpt or tiers:
        ftcb = FtkitCallback(
            tiers or [ckpt], every_n_steps=every, resume_dir=resume_dir, ignore_existing=ignore_existing
        )
    callbacks = ([ftcb] if ftcb else []) + [trace, *callbacks]
    if fail_at is not None:
        callbacks.append(FailAt(fail_at, kill=kill, flush=ftcb))
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=eval_dataset, callbacks=callbacks)
    return trainer, trace, ftcb


def train(trainer, ftcb):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return trainer.train(resume_from_checkpoint=ftcb.resume_from_checkpoint() if ftcb else None)


def final_values(trainer) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in trainer.model.state_dict().items()}
    for pid, st in trainer.optimizer.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim/{pid}/{k}"] = v.clone() if isinstance(v, torch.Tensor) else torch.tensor(v)
    return out


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"differ: {differ}"


@pytest.fixture(autouse=True)
def _quiet_transformers():
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    yield
    hf_logging.set_verbosity(level)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run the others must equal."""
    trainer, trace, _ = make_trainer(str(tmp_path_factory.mktemp("ref")), None)
    out = train(trainer, None)
    assert out.global_step == trainer.state.global_step == EPOCHS * STEPS_PER_EPOCH
    assert trace.steps[0][0] == 0 and len(trace.steps) == EPOCHS * STEPS_PER_EPOCH
    return final_values(trainer), trainer.lr_scheduler.state_dict(), trace.steps, trainer.state.epoch


def test_sigkill_mid_epoch_then_resume_equals_uninterrupted_run(tmp_path, reference):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    r = subprocess.run(
        [sys.executable, HERE, out, ckpt, "13", "3"],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join([SUPPORT, os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    assert committed_steps(ftkit.Tier(ckpt).open()) == [9, 12]  # keep=2; 13 is not a multiple of 3

    trainer, trace, ftcb = make_trainer(out, ckpt, every=3)
    result = train(trainer, ftcb)
    assert ftcb.restored_step == 12
    assert trace.at_start == (12, 1.2)  # epoch 1, 2 of its 10 steps done
    assert not os.path.exists(os.path.join(out, "ftkit-resume"))  # removed once training began
    ref_values, ref_sched, ref_steps, ref_epoch = reference
    assert trace.steps == ref_steps[12:]  # the same batches, in the same order, at the same steps
    assert result.global_step == trainer.state.global_step == EPOCHS * STEPS_PER_EPOCH
    assert trainer.state.epoch == ref_epoch == EPOCHS
    assert trainer.optimizer.state_dict()["state"][0]["step"] == EPOCHS * STEPS_PER_EPOCH
    assert_bitwise_equal(final_values(trainer), ref_values)
    assert trainer.lr_scheduler.state_dict() == ref_sched
    assert committed_steps(ftkit.Tier(ckpt).open()) == [27, 30]  # 30 at on_train_end


def test_exception_at_epoch_end_then_resume_equals_uninterrupted_run(tmp_path, reference):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    trainer, _, ftcb = make_trainer(out, ckpt, every=5, fail_at=11)
    try:
        with pytest.raises(RuntimeError, match="injected failure at step 11"):
            train(trainer, ftcb)
    finally:
        ftcb.close()  # the documented finally: flush what was staged
    assert committed_steps(ftkit.Tier(ckpt).open()) == [5, 10]  # 10: the last step of epoch 0

    trainer, trace, ftcb = make_trainer(out, ckpt, every=5)
    train(trainer, ftcb)
    assert ftcb.restored_step == 10 and trace.at_start == (10, 1.0)
    ref_values, ref_sched, ref_steps, _ = reference
    assert trace.steps == ref_steps[10:]
    assert trainer.state.global_step == EPOCHS * STEPS_PER_EPOCH
    assert_bitwise_equal(final_values(trainer), ref_values)
    assert trainer.lr_scheduler.state_dict() == ref_sched


def test_a_resume_restores_the_callbacks_states_as_of_the_snapshot(tmp_path):
    """EarlyStoppingCallback's patience counter, an ExportableState the Trainer restores with
    restore_callback_states_from_checkpoint: resumed from step 6 (two evaluations without
    improvement), the run stops where the uninterrupted one does, at the third (step 8)."""

    def make(out, ckpt, **kw):
        early_stop = EarlyStoppingCallback(3, early_stopping_threshold=1e9)  # no evaluation improves enough
        return make_trainer(
            out,
            ckpt,
            callbacks=[early_stop],
            eval_dataset=Tokens(8),
            eval_strategy="steps",
            eval_steps=2,
            metric_for_best_model="loss",
            restore_callback_states_from_checkpoint=True,
            **kw,
        )

    trainer, _, _ = make(str(tmp_path / "ref"), None)
    train(trainer, None)
    assert trainer.state.global_step == 8
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    trainer, _, ftcb = make(out, ckpt, fail_at=7)  # step 6 is snapshotted as step 7 begins
    with pytest.raises(RuntimeError):
        train(trainer, ftcb)
    ftcb.close()
    trainer, _, ftcb = make(out, ckpt)
    train(trainer, ftcb)
    assert ftcb.restored_step == 6 and trainer.state.global_step == 8
    optimizer = weakref.ref(trainer.optimizer)
    del trainer
    gc.collect()
    assert optimizer() is None  # the callback, still held, keeps the Trainer's optimizer alive no more


def test_train_without_the_resume_directory_refuses_to_start_over(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    trainer, _, ftcb = make_trainer(out, ckpt, every=5, fail_at=6)  # step 5 is snapshotted as step 6 begins
    with pytest.raises(RuntimeError):
        train(trainer, ftcb)
    ftcb.close()
    trainer, trace, ftcb = make_trainer(out, ckpt, every=5)
    with pytest.raises(ftkit.FtkitError, match=r"holds snapshots up to step 5; resume with"):
        trainer.train()
    assert trace.steps == []
    assert committed_steps(ftkit.Tier(ckpt).open()) == [5]


def test_snapshot_of_a_different_model_fails_restore_naming_keys(tmp_path):
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    trainer, _, ftcb = make_trainer(out, ckpt, every=5, fail_at=6)  # step 5 is snapshotted as step 6 begins
    with pytest.raises(RuntimeError):
        train(trainer, ftcb)
    ftcb.close()
    trainer, trace, ftcb = make_trainer(out, ckpt, n_embd=48)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with pytest.raises(ftkit.StateMismatchError) as err:
        ftcb.resume_from_checkpoint()
    msg = str(err.value)
    assert "model/transformer.wte.weight: shape (64, 32) in checkpoint, (64, 48) live" in msg
    assert "model/transformer.h.0.attn.c_attn.weight" in msg
    assert_bitwise_equal(dict(trainer.model.state_dict()), before)  # untouched
    assert not os.path.exists(os.path.join(out, "ftkit-resume"))


def test_fsdp1_is_refused_and_fsdp2_is_taken(tmp_path):
    """FSDP1 keeps its state in flat shards the callback cannot restore: refused (at Trainer
    construction, on_init_end). FSDP2 and no FSDP are taken. (A one-process CPU Trainer
    with FSDP cannot be built at all; the multi-process tests run the FSDP2 path.)"""
    from ftkit.integrations._hf_resume import check_fsdp_args

    def args(**kw):
        return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], **kw)

    with pytest.raises(ftkit.FtkitError, match=r"FSDP2 only \(fsdp_config=\{'version': 2\}\)"):
        check_fsdp_args(args(fsdp=True, fsdp_config={"version": 1}))
    check_fsdp_args(args(fsdp=True, fsdp_config={"version": 2}))
    check_fsdp_args(args())


def test_unreachable_tier_fails_when_the_trainer_is_built(tmp_path):
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
        make_trainer(str(tmp_path / "out"), None, tiers=[str(tmp_path / "local"), tier])
    msg = str(err.value)
    assert "FtkitCallback: checkpoint tier s3://bucket/run cannot be used" in msg
    assert "Could not connect" in msg and "not-a-real-secret-123" not in msg


def _child(out: str, ckpt: str, kill_at: int, every: int) -> None:
    warnings.simplefilter("ignore")
    hf_logging.set_verbosity_error()
    logging.disable(logging.WARNING)
    trainer, _, ftcb = make_trainer(out, ckpt, every=every, fail_at=kill_at, kill=True)
    train(trainer, ftcb)
    raise SystemExit("the child should have been killed")


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))


@pytest.mark.parametrize("kind", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_the_fsdp_resume_directory_holds_the_weights_in_the_trainers_layout(tmp_path, kind):
    """What accelerate's FSDP load reads (one process here): a DCP directory under "model"
    for the sharded type, a weights-only file for the full one; and the Trainer's state."""
    import types

    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import StateDictType

    from ftkit.integrations._hf_resume import MARKER, write_handoff

    model = make_model()
    fresh = type(model)(model.config)  # other weights
    torch.nn.init.zeros_(fresh.transformer.wte.weight)
    plugin = types.SimpleNamespace(state_dict_type=StateDictType[kind])
    path = str(tmp_path / "resume")
    os.makedirs(path)
    (tmp_path / "resume" / MARKER).write_text("")  # an earlier resume's directory, ftkit's own
    (tmp_path / "resume" / "stale").write_text("from an earlier resume")
    write_handoff(model, path, plugin, "{}")
    weights = "pytorch_model_fsdp_0" if kind == "SHARDED_STATE_DICT" else "pytorch_model_fsdp.bin"
    assert sorted(os.listdir(path)) == sorted([MARKER, "trainer_state.json", weights])
    if kind == "SHARDED_STATE_DICT":
        loaded = {"model": fresh.state_dict()}
        dcp.load(loaded, checkpoint_id=os.path.join(path, "pytorch_model_fsdp_0"))
        fresh.load_state_dict(loaded["model"])
    else:
        fresh.load_state_dict(torch.load(os.path.join(path, "pytorch_model_fsdp.bin"), weights_only=True))
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_a_resume_dir_that_ftkit_did_not_write_is_refused_never_emptied(tmp_path):
    """resume_dir naming the run's own folder (it holds the tier and the user's files): the
    callback refuses it in one line and deletes nothing; a new directory works, and is gone
    once training has begun."""
    run = tmp_path / "run"
    ckpt, out = str(run / "ckpt"), str(tmp_path / "out")
    trainer, _, ftcb = make_trainer(out, ckpt, every=5, fail_at=6)
    with pytest.raises(RuntimeError):
        train(trainer, ftcb)
    ftcb.close()
    (run / "notes.txt").write_text("mine")
    trainer, trace, ftcb = make_trainer(out, ckpt, every=5, resume_dir=str(run))
    with pytest.raises(ftkit.FtkitError, match=r"resume_dir .*run exists and is not a resume directory ftkit wrote"):
        ftcb.resume_from_checkpoint()
    assert (run / "notes.txt").read_text() == "mine" and committed_steps(ftkit.Tier(ckpt).open()) == [5]
    ftcb.close()
    trainer, trace, ftcb = make_trainer(out, ckpt, every=5, resume_dir=str(tmp_path / "handoff"))
    train(trainer, ftcb)
    assert ftcb.restored_step == 5 and not (tmp_path / "handoff").exists()
    assert trainer.state.global_step == EPOCHS * STEPS_PER_EPOCH


def test_starting_over_retires_the_earlier_runs_snapshots(tmp_path):
    """ignore_existing=True over a finished run's tier: the new run's snapshots are kept (the
    old run's steps of the same numbers refused them), and a restart after its failure resumes
    the new run, not the old run's newer steps."""
    ckpt = str(tmp_path / "ckpt")
    trainer, _, ftcb = make_trainer(str(tmp_path / "a"), ckpt, every=5)
    train(trainer, ftcb)
    ftcb.close()
    assert committed_steps(ftkit.Tier(ckpt).open())[-1] == EPOCHS * STEPS_PER_EPOCH
    trainer, _, ftcb = make_trainer(str(tmp_path / "b"), ckpt, every=5, fail_at=11, ignore_existing=True)
    with pytest.raises(RuntimeError, match="injected failure at step 11"):
        trainer.train()
    ftcb.close()
    assert committed_steps(ftkit.Tier(ckpt).open()) == [5, 10]  # run b's; run a's 25 and 30 retired
    trainer, trace, ftcb = make_trainer(str(tmp_path / "b"), ckpt, every=5)
    train(trainer, ftcb)
    assert ftcb.restored_step == 10 and trace.steps[0][0] == 10


def test_the_last_step_is_snapshotted_whatever_every_n_steps_says(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    trainer, _, ftcb = make_trainer(str(tmp_path / "out"), ckpt, every=4)
    train(trainer, ftcb)
    assert committed_steps(ftkit.Tier(ckpt).open()) == [28, EPOCHS * STEPS_PER_EPOCH]
    trained = final_values(trainer)
    trainer, _, ftcb = make_trainer(str(tmp_path / "out"), ckpt, every=4)
    resume = ftcb.resume_from_checkpoint()  # the weights of the newest step, loaded
    assert json.loads(open(os.path.join(resume, "trainer_state.json")).read())["global_step"] == 30
    model = {k: v for k, v in trained.items() if k.startswith("model/")}
    assert_bitwise_equal({f"model/{k}": v for k, v in trainer.model.state_dict().items()}, model)
