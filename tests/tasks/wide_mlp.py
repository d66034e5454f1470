"""A wide MLP with dropout on synthetic data: big matrix products, so that float64 results that land near
a float32 midpoint (where CPUs disagree) occur every step. Used to show that the log is needed."""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from veritrain import Task, randomness


def make_task(config):
    width = int(config.get("width", 2048))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, width), nn.GELU(), nn.Dropout(0.1), nn.Linear(width, width), nn.Tanh(),
                          nn.Linear(width, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)  # not torch.randn: its float32 values depend on the CPU
    x = torch.from_numpy(rng.standard_normal((1024, 256)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, 1024))
    bs = int(config.get("batch_size", 128))

    def batch(step):
        idx = torch.from_numpy(randomness.epoch_order(0, step, bs, 1024))
        return x[idx], y[idx]

    return Task(model=model, optimizer=opt, batch=batch, loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))
