"""The tiny causal LM and token data both Hugging Face Trainer tests train (no downloads)."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel


class Tokens(torch.utils.data.Dataset):
    """`n` fixed random sequences of 16 tokens; labels = input_ids (causal LM)."""

    def __init__(self, n: int = 40, length: int = 16, vocab: int = 64):
        g = torch.Generator().manual_seed(123)
        self.data = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


def make_model(n_embd: int = 32) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_embd=n_embd, n_head=2, vocab_size=64, n_positions=32)  # dropout 0.1: RNG
    return GPT2LMHeadModel(cfg)
