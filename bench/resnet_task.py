"""ResNet-18 (CIFAR variant) on CIFAR-shaped synthetic images, for benchmarks and calibration.

A task in the `module:function` contract (`PYTHONPATH=bench veritrain train resnet_task:make_task`).
The images are fixed pseudo-random tensors drawn with NumPy (never torch.randn: its float32 values
depend on the CPU's vector instruction set), so the task needs no dataset download.
"""

import numpy as np
import torch
import torch.nn.functional as F

from veritrain import Task, randomness
from veritrain.tasks.resnet import resnet18

DEFAULTS = {"width": 64, "batch_size": 32, "examples": 512, "lr": 0.05, "init_seed": 0, "data_seed": 0}


def make_task(config):
    cfg = {**DEFAULTS, **config}
    torch.manual_seed(int(cfg["init_seed"]))
    model = resnet18(width=int(cfg["width"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=float(cfg["lr"]), momentum=0.9, weight_decay=5e-4)
    rng = np.random.default_rng(int(cfg["data_seed"]))
    n = int(cfg["examples"])
    images = torch.from_numpy(rng.standard_normal((n, 3, 32, 32)).astype(np.float32))
    labels = torch.from_numpy(rng.integers(0, 10, n))
    bs = int(cfg["batch_size"])

    def batch_indices(step):
        return randomness.epoch_order(int(cfg["data_seed"]), step, bs, n).tolist()

    def batch(step):
        idx = torch.tensor(batch_indices(step))
        return images[idx], labels[idx]

    return Task(model=model, optimizer=optimizer, batch=batch, batch_indices=batch_indices,
                loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


make_task.defaults = DEFAULTS
