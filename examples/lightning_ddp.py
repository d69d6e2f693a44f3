"""Lightning DDP + ftkit, several processes: run it, kill it, drill it.

    ftkit run --preload lightning.pytorch --nproc-per-node 2 examples/lightning_ddp.py --ckpt /tmp/ftkit-pl-ddp
    ftkit drill --script examples/lightning_ddp.py --preload lightning.pytorch --nproc 2 --steps 60 \\
        --faults "kill@15:rank=1,hang@30:rank=0,crash@45:rank=1" -- --ckpt /tmp/ftkit-pl-ddp

Every rank snapshots its share to node RAM (a copy on the next node) every step and to
--ckpt every 5 steps; a restarted job resumes from the newest snapshot on whatever number
of ranks it has. The training loader's ResumableDistributedSampler (with
``use_distributed_sampler=False``) makes the data order one global stream that the resumed
job continues exactly. Nothing here knows about drills: the drill injects its faults
through ftkit and judges the run from ftkit's event log.
"""

import argparse
import os
import time
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

import ftkit
from ftkit.integrations.lightning import FtkitCallback


class Regressor(pl.LightningModule):
    def __init__(self, step_time: float):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)
        )
        self.step_time = step_time

    def training_step(self, batch, batch_idx):
        x, y = batch
        time.sleep(self.step_time)  # stands in for a real model's compute
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        ds = TensorDataset(torch.randn(512, 8, generator=g), torch.randn(512, 1, generator=g))
        return DataLoader(ds, batch_size=8, sampler=ftkit.ResumableDistributedSampler(ds, seed=0))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True, help="the durable tier (a directory or any fsspec URL)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-time", type=float, default=0.05)
    a = p.parse_args()
    pl.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tiers = [ftkit.Tier("ram", replicas=1), ftkit.Tier(a.ckpt, every=5)]
    trainer = pl.Trainer(
        max_steps=a.steps,
        accelerator="cpu",
        devices=world,
        strategy="ddp" if world > 1 else "auto",
        use_distributed_sampler=False,  # the ResumableDistributedSampler shards the stream itself
        deterministic=True,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,  # ftkit is the checkpointing
        enable_model_summary=False,
        callbacks=[FtkitCallback(tiers, every_n_steps=1)],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on num_workers
        trainer.fit(Regressor(a.step_time))


if __name__ == "__main__":
    main()
