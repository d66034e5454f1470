"""A small CNN (conv, BatchNorm, ReLU, max-pool, dropout) on scikit-learn's 8x8 digits.

The default task of ``veritrain demo``: it runs in seconds on a CPU and uses every kind of op that
makes float32 training hardware-dependent (convolution, BatchNorm statistics, softmax, AdamW).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from veritrain import randomness
from veritrain.task import Task, TaskError, check_ranges, current_device

DEFAULTS = {
    "optimizer": "adamw",  # or "sgd" (momentum 0.9)
    "lr": 3e-3,
    "weight_decay": 1e-2,
    "batch_size": 64,
    "width": 16,
    "dropout": 0.1,
    "init_seed": 0,
    "data_seed": 0,
    "held_out": 297,  # the last examples of the data set
}
RANGES = {"lr": "[0, inf)", "weight_decay": "[0, inf)", "batch_size": "[1, inf)", "width": "[1, inf)",
          "dropout": "[0, 1)", "held_out": "[1, inf)"}


class DigitsCNN(nn.Module):
    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(2 * width)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(2 * width * 2 * 2, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc(self.drop(x.flatten(1)))


def load_digits_arrays():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = d.images.astype(np.float64) / 16.0
    # standardised pixels, as one would preprocess any image data (raw k/16 values would make many
    # float64 sums exact float32 ties, which the trainer logs conservatively)
    x = (x - x.mean()) / x.std()
    return x.astype(np.float32)[:, None, :, :], d.target.astype(np.int64)


def make_optimizer(name: str, params, lr: float, weight_decay: float):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    raise TaskError(f"config 'optimizer' must be 'adamw' or 'sgd', got {name!r}")


def make_task(config: dict) -> Task:
    cfg = {**DEFAULTS, **config}
    unknown = set(config) - set(DEFAULTS)
    if unknown:
        raise TaskError(f"digits-cnn: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    check_ranges("digits-cnn", cfg, RANGES)
    images, labels = load_digits_arrays()
    n_train = len(images) - int(cfg["held_out"])
    if n_train <= 0 or int(cfg["batch_size"]) <= 0:
        raise TaskError("digits-cnn: held_out and batch_size leave no training data")
    x_train, y_train = torch.from_numpy(images[:n_train]), torch.from_numpy(labels[:n_train])
    x_test, y_test = torch.from_numpy(images[n_train:]), torch.from_numpy(labels[n_train:])

    torch.manual_seed(int(cfg["init_seed"]))  # initial weights are committed in the first checkpoint
    model = DigitsCNN(int(cfg["width"]), float(cfg["dropout"]))
    optimizer = make_optimizer(cfg["optimizer"], model.parameters(), float(cfg["lr"]), float(cfg["weight_decay"]))
    bs, seed = int(cfg["batch_size"]), int(cfg["data_seed"])

    def batch_indices(step: int):
        return randomness.epoch_order(seed, step, bs, n_train).tolist()

    def batch(step: int):
        idx = torch.tensor(batch_indices(step))
        return x_train[idx], y_train[idx]

    def loss(model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def evaluate(model):
        was = model.training
        model.eval()
        x, y = x_test.to(current_device()), y_test.to(current_device())  # held-out data, where the model is
        with torch.no_grad():
            logits = model(x)
            acc = (logits.argmax(1) == y).double().mean().item()
            nll = F.cross_entropy(logits, y).item()
        model.train(was)
        return {"accuracy": acc, "loss": nll, "examples": len(y_test)}

    return Task(model=model, optimizer=optimizer, batch=batch, loss=loss, evaluate=evaluate,
                batch_indices=batch_indices)


make_task.defaults = DEFAULTS
make_task.data_paths = {}  # reads no files
