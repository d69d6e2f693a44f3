"""A Hugging Face Trainer under torchrun (DDP or FSDP2 over gloo), for tests/drills/test_integrations_multiprocess.py.

A tiny GPT-2 from a local config trains 3 epochs. Every rank appends, line by line, the
global step, a digest of the batch and its rows' dataset indices of each step it trains to
OUT/trace-w<world>-r<rank>-a<attempt>.jsonl; rank 0 writes the restored step and the final
weights and optimizer state to OUT/final-w<world>-a<attempt>.pt. --kill-at K: in the first
attempt, rank 1 SIGKILLs itself once the snapshot of step K is in. With --fsdp
SHARDED_STATE_DICT, the final state is also saved to OUT/accelerate/ as the Trainer saves
an FSDP checkpoint (accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer``: DCP directories).

--fsdp: FSDP2 through accelerate's plugin (``fsdp_config={"version": 2}``, each GPT-2 block
and the whole model sharded). accelerate turns FSDP on only for accelerator devices and
trains a CPU job under DDP; `_fsdp_on_cpu` lifts that one gate, so its real FSDP2 path
(``fully_shard``, DTensor parameters and optimizer state, its FSDP resume) runs over gloo.

    torchrun --nproc-per-node 2 tests/support/huggingface_ddp_job.py --ckpt DIR --out DIR [--kill-at K] [--fsdp TYPE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time
import warnings

import torch
from hfkit import Tokens, make_model
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

from ftkit.format.reader import committed_steps
from ftkit.integrations.huggingface import FtkitCallback

EPOCHS = 3


class Trace(TrainerCallback):
    """Each training forward's (global step, batch digest), written as it happens."""

    def __init__(self, model, path: str, kill_at: int | None, ftcb: FtkitCallback, rank: int, data: Tokens):
        self.path, self.kill_at, self.ftcb, self.rank = path, kill_at, ftcb, rank
        self.index = {row.numpy().tobytes(): i for i, row in enumerate(data.data)}  # a row's dataset index
        self.state = None
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if module.training and self.state is not None:
            ids = kwargs["input_ids"]
            digest = hashlib.sha1(ids.numpy().tobytes()).hexdigest()[:12]
            idx = [self.index.get(row.numpy().tobytes()) for row in ids]
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": self.state.global_step, "batch": digest, "idx": idx}) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        self.state = state

    def on_step_begin(self, args, state, control, **kwargs):  # after FtkitCallback's snapshot of the step before
        if self.kill_at is not None and state.global_step == self.kill_at and self.rank == 1:
            wait_committed(self.ftcb, self.kill_at)
            os.kill(os.getpid(), signal.SIGKILL)  # no finally, no flush: a crash


def wait_committed(ftcb: FtkitCallback, step: int) -> None:
    """Until rank 0 has committed `step` (so the test knows which step is newest)."""
    ftcb.checkpointer.wait()
    deadline = time.monotonic() + 60
    while step not in committed_steps(ftcb.tiers[0].open()) and time.monotonic() < deadline:
        time.sleep(0.02)


def _fsdp_on_cpu() -> None:
    """Let accelerate set up FSDP for a CPU (gloo) job, as it does for a GPU one."""
    import accelerate.state
    from accelerate.utils import DistributedType

    init = accelerate.state.AcceleratorState.__init__

    def patched(self, *a, fsdp_plugin=None, **kw):
        init(self, *a, fsdp_plugin=fsdp_plugin, **kw)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            accelerate.state.PartialState._shared_state["distributed_type"] = (
                self.distributed_type
            )  # as accelerate does

    accelerate.state.AcceleratorState.__init__ = patched


def full_state(trainer) -> dict[str, torch.Tensor]:
    """The final weights and optimizer state, whole (collective under FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer.optimizer, options=opts)
    final = {f"model/{k}": v for k, v in model_sd.items()}
    final |= {f"optim/{n}/{k}": torch.as_tensor(v) for n, st in optim_sd["state"].items() for k, v in st.items()}
    return final


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--fsdp", choices=["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
    args = p.parse_args()
    if args.fsdp:
        _fsdp_on_cpu()
    fsdp = {}
    if args.fsdp:
        fsdp = {
            "fsdp": True,
            "fsdp_config": {"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"], "state_dict_type": args.fsdp},
        }
    hf_logging.set_verbosity_error()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model = make_model()
    targs = TrainingArguments(
        output_dir=os.path.join(args.out, "hf"),
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
        ddp_backend="gloo",
        **fsdp,
    )
    ftcb = FtkitCallback([args.ckpt], every_n_steps=1)
    kill_at = args.kill_at if attempt == 0 else None
    data = Tokens(48)
    trace = Trace(model, os.path.join(args.out, f"trace-w{world}-r{rank}-a{attempt}.jsonl"), kill_at, ftcb, rank, data)
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[ftcb, trace])
    with warnings.catch_warnings(), ftcb:
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=ftcb.resume_from_checkpoint())
    if args.fsdp == "SHARDED_STATE_DICT":
        from accelerate.utils import save_fsdp_model, save_fsdp_optimizer

        acc, where = trainer.accelerator, os.path.join(args.out, "accelerate")
        save_fsdp_model(acc.state.fsdp_plugin, acc, trainer.model, where)
        save_fsdp_optimizer(acc.state.fsdp_plugin, acc, trainer.optimizer, trainer.model, where)
    final = full_state(trainer)
    sharded = type(next(trainer.model.parameters())).__name__ == "DTensor"
    if rank == 0:
        torch.save(
            {"final": final, "sharded": sharded, "restored": ftcb.restored_step, "step": trainer.state.global_step},
            os.path.join(args.out, f"final-w{world}-a{attempt}.pt"),
        )


if __name__ == "__main__":
    main()
