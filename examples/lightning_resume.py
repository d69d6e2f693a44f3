"""Lightning + ftkit: snapshot every few steps, crash, run again, carry on exactly.

    python examples/lightning_resume.py /tmp/ftkit-pl --fresh            # an uninterrupted run, for comparison
    python examples/lightning_resume.py /tmp/ftkit-pl --fresh --crash-at 23  # starts over, SIGKILLed at step 23
    python examples/lightning_resume.py /tmp/ftkit-pl                    # resumes, finishes

The last line each run prints is the final step and a digest of the weights: the resumed
run's equals the uninterrupted run's.

The resume starts from the newest snapshot that was committed before the kill: step 20, or
an earlier one if 20 was still being written (snapshots persist in the background).
"""

import argparse
import hashlib
import os
import shutil
import signal
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from ftkit.integrations.lightning import FtkitCallback


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=10)}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, shuffle=True)


class CrashAt(pl.Callback):
    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
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
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    pl.seed_everything(0)
    ftkit_cb = FtkitCallback([a.ckpt], every_n_steps=5)
    callbacks = [ftkit_cb] + ([CrashAt(a.crash_at)] if a.crash_at else [])
    trainer = pl.Trainer(
        max_epochs=5,
        deterministic=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=callbacks,
    )
    model = Regressor()
    trainer.fit(model)
    digest = hashlib.sha256(b"".join(v.numpy().tobytes() for v in model.state_dict().values())).hexdigest()
    print(
        f"resumed from step {ftkit_cb.restored_step}; final step {trainer.global_step}, "
        f"epoch {trainer.current_epoch}; weights {digest[:16]}"
    )


if __name__ == "__main__":
    main()
