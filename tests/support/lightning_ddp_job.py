"""A Lightning DDP fit under torchrun, for tests/drills/test_integrations_multiprocess.py.

Every rank appends what each training step consumed to OUT/trace-r<rank>-a<attempt>.jsonl
(the global step before it, the epoch, the dataset indices of its batch), line by line so a
SIGKILL keeps what was written. Rank 0 writes the restored step and, at the end, the final
weights and optimizer state to OUT/final-a<attempt>.pt. --kill-at K: in the first attempt,
rank 1 SIGKILLs itself after the snapshot of global step K is in (no finally, no flush).

    torchrun --nproc-per-node 2 tests/support/lightning_ddp_job.py --ckpt DIR --out DIR \
        [--resumable] [--fsdp] [--kill-at K]

--fsdp: FSDP2 through Lightning's ModelParallelStrategy (fully_shard in configure_model) on
gloo: parameters and optimizer state are DTensors, saved and restored as each rank's shards.

Started by srun instead (SLURM_NTASKS, SLURM_PROCID, ... set; no torchrun), Lightning runs it
in its SLURM environment and the attempt is SLURM_RESTART_COUNT. --signal-at K: in the first
attempt, rank 1 sends itself SIGUSR1 (SLURM's warning before the time limit) after step K;
--step-sleep S: each step takes S seconds more (the other rank hears of it meanwhile).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import warnings

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

import ftkit
from ftkit.format.reader import committed_steps
from ftkit.integrations.lightning import FtkitCallback

SAMPLES, BATCH, EPOCHS = 48, 4, 3


class Indexed(Dataset):
    """Fixed random features and targets; each sample carries its index, so the trace says which it was."""

    def __init__(self):
        g = torch.Generator().manual_seed(123)
        self.x, self.y = torch.randn(SAMPLES, 8, generator=g), torch.randn(SAMPLES, 1, generator=g)

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


class Net(pl.LightningModule):
    """Dropout (each rank's RNG), AdamW (state), a per-step scheduler (state)."""

    def __init__(self, resumable: bool, fsdp: bool = False):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
        )
        self.resumable = resumable
        self.fsdp = fsdp

    def configure_model(self):
        if not self.fsdp:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return (self.net(x) - y).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        ds = Indexed()
        if self.resumable:  # one global stream whatever the world size (use_distributed_sampler=False)
            return DataLoader(ds, batch_size=BATCH, sampler=ftkit.ResumableDistributedSampler(ds, seed=7))
        return DataLoader(ds, batch_size=BATCH, shuffle=True)  # Lightning puts a DistributedSampler in


class Trace(pl.Callback):
    def __init__(self, path: str, kill_at: int | None, ftcb: FtkitCallback, signal_at: int | None, sleep: float):
        self.path, self.kill_at, self.ftcb = path, kill_at, ftcb
        self.signal_at, self.sleep = signal_at, sleep

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        rec = {"step": trainer.global_step, "epoch": trainer.current_epoch, "idx": batch[2].tolist()}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.sleep)
        if self.signal_at is not None and trainer.global_step == self.signal_at and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        if self.kill_at is not None and trainer.global_step == self.kill_at and trainer.global_rank == 1:
            self.ftcb.checkpointer.wait()  # this rank's share of step K is in; rank 0 commits it:
            deadline = time.monotonic() + 60  # K is then the newest step (the test knows which)
            while self.kill_at not in committed_steps(self.ftcb.tiers[0].open()) and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--resumable", action="store_true")
    p.add_argument("--kill-at", type=int)
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--signal-at", type=int)
    p.add_argument("--step-sleep", type=float, default=0.0)
    args = p.parse_args()
    env = os.environ
    rank = int(env["RANK"] if "RANK" in env else env["SLURM_PROCID"])
    world = int(env["WORLD_SIZE"] if "WORLD_SIZE" in env else env["SLURM_NTASKS"])
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT", env.get("SLURM_RESTART_COUNT", "0")))
    pl.seed_everything(0, verbose=False)
    ftcb = FtkitCallback([args.ckpt], every_n_steps=1)
    kill_at, signal_at = (args.kill_at, args.signal_at) if attempt == 0 else (None, None)
    trace_path = os.path.join(args.out, f"trace-w{world}-r{rank}-a{attempt}.jsonl")
    trace = Trace(trace_path, kill_at, ftcb, signal_at, args.step_sleep)
    trainer = pl.Trainer(
        max_epochs=EPOCHS,
        accelerator="cpu",
        devices=world,
        strategy=_strategy(args.fsdp, world),
        deterministic=True,
        use_distributed_sampler=not args.resumable,
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[ftcb, trace],
    )
    model = Net(args.resumable, args.fsdp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on num_workers etc.
        trainer.fit(model)
    opt = trainer.optimizers[0].state_dict()["state"]
    final = {f"model/{k}": _full(v) for k, v in model.state_dict().items()}  # (every rank: a collective)
    final |= {f"optim/{i}/{k}": _full(torch.as_tensor(v)) for i, st in opt.items() for k, v in st.items()}
    if rank == 0:
        torch.save(
            {
                "final": final,
                "restored": ftcb.restored_step,
                "step": trainer.global_step,
                "epoch": trainer.current_epoch,
            },
            os.path.join(args.out, f"final-w{world}-a{attempt}.pt"),
        )


def _strategy(fsdp: bool, world: int):
    if not fsdp:
        return "ddp"
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


if __name__ == "__main__":
    main()
