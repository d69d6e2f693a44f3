"""transformers.Trainer + ftkit: snapshot every few steps, crash, run again, carry on exactly.

    python examples/huggingface_resume.py /tmp/ftkit-hf --fresh          # an uninterrupted run, for comparison
    python examples/huggingface_resume.py /tmp/ftkit-hf --fresh --crash-at 23  # starts over, SIGKILLed at step 23
    python examples/huggingface_resume.py /tmp/ftkit-hf                  # resumes, finishes

A tiny GPT-2 built from a config (nothing is downloaded) learns fixed random token
sequences on the CPU. The last line each run prints is the final step and a digest of
the weights: the resumed run's equals the uninterrupted run's.

The resume starts from the newest snapshot that was committed before the kill: step 20, or
an earlier one if 20 was still being written (snapshots persist in the background).
"""

import argparse
import hashlib
import os
import shutil
import signal
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from ftkit.integrations.huggingface import FtkitCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class CrashAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            print(f"crashing at step {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("ckpt", help="ftkit tier: a directory, or s3://bucket/prefix")
    p.add_argument("--crash-at", type=int)
    p.add_argument("--fresh", action="store_true", help="delete the checkpoints first")
    a = p.parse_args()
    if a.fresh and os.path.isdir(a.ckpt):
        shutil.rmtree(a.ckpt)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=64, n_positions=32))
    args = TrainingArguments(
        output_dir=os.path.join(tempfile.gettempdir(), "ftkit-hf-example-out"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        per_device_train_batch_size=8,
        num_train_epochs=5,
        learning_rate=1e-3,
        logging_steps=10,
        seed=0,
        disable_tqdm=True,
    )
    ftkit_cb = FtkitCallback([a.ckpt], every_n_steps=5)
    callbacks = [ftkit_cb] + ([CrashAt(a.crash_at)] if a.crash_at else [])
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    with ftkit_cb:  # the Trainer has no exception hook: this flushes what was staged (and reports a failure)
        trainer.train(resume_from_checkpoint=ftkit_cb.resume_from_checkpoint())  # None: a fresh start
    digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.state_dict().values())).hexdigest()
    print(
        f"resumed from step {ftkit_cb.restored_step}; final step {trainer.state.global_step}, "
        f"epoch {trainer.state.epoch:g}; weights {digest[:16]}"
    )


if __name__ == "__main__":
    main()
