"""Hugging Face Trainer + ftkit, several processes (DDP over gloo): run it, kill it, drill it.

    ftkit run --preload transformers.trainer --nproc-per-node 2 examples/huggingface_ddp.py --ckpt /tmp/ftkit-hf-ddp
    ftkit drill --script examples/huggingface_ddp.py --preload transformers.trainer --nproc 2 --steps 60 \\
        --faults "kill@15:rank=1,hang@30:rank=0,crash@45:rank=1" -- --ckpt /tmp/ftkit-hf-ddp

A tiny GPT-2 built from a local config (no download). Every rank snapshots its share to
node RAM (a copy on the next node) every step and to --ckpt every 5 steps; the Trainer's
own checkpoints are off (``save_strategy="no"``): ftkit is the checkpointing. A restarted
job resumes from the newest snapshot: each rank gets its own RNG state and resume
directory back, and the Trainer skips the batches already trained on.
"""

import argparse
import time
import warnings

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

import ftkit
from ftkit.integrations.huggingface import FtkitCallback


class Tokens(torch.utils.data.Dataset):
    """Fixed random sequences of 16 tokens; labels = input_ids (causal LM)."""

    def __init__(self, n: int = 1024, length: int = 16, vocab: int = 64):
        self.data = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


class Pace(TrainerCallback):
    """Stands in for a real model's compute time."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(self.seconds)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True, help="the durable tier (a directory or any fsspec URL)")
    p.add_argument("--out", default="/tmp/ftkit-hf-ddp-out", help="the Trainer's output_dir (logs only)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.05)
    a = p.parse_args()
    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    args = TrainingArguments(
        output_dir=a.out,
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        save_strategy="no",  # ftkit is the checkpointing
        dataloader_num_workers=0,
        per_device_train_batch_size=4,
        max_steps=a.steps,
        learning_rate=1e-3,
        seed=0,
        disable_tqdm=True,
    )
    ftkit_cb = FtkitCallback([ftkit.Tier("ram", replicas=1), ftkit.Tier(a.ckpt, every=5)], every_n_steps=1)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[ftkit_cb, Pace(a.step_time)])
    with warnings.catch_warnings(), ftkit_cb:  # flushes at the end; reports a failure to the other ranks at once
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=ftkit_cb.resume_from_checkpoint())


if __name__ == "__main__":
    main()
