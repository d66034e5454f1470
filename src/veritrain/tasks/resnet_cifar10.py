"""The paper's image workload: ResNet-18 or ResNet-50 (CIFAR variant) on CIFAR-10, SGD with momentum and
weight decay, random crop (4-pixel padding) and horizontal flip.

The augmentation is drawn from veritrain's counter-based randomness, keyed by (data_seed, step), so the
trainer and any auditor build the same batches. ``data`` is the CIFAR-10 python archive
(``cifar-10-python.tar.gz`` or its extracted folder) or ``digits`` (scikit-learn's digits as 3x32x32).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from veritrain import randomness
from veritrain.task import Task, TaskError, check_ranges, current_device
from veritrain.tasks.cifar import FOLDER, digits_as_cifar, load_cifar10, normalize
from veritrain.tasks.resnet import resnet18, resnet50

DEFAULTS = {
    "data": None,          # path to cifar-10-python.tar.gz / its folder, or "digits" (required)
    "arch": "resnet18",    # or "resnet50"
    "width": 64,           # channels of the first stage (64 = the standard ResNet)
    "batch_size": 64,
    "lr": 0.05,
    "momentum": 0.9,
    "weight_decay": 5e-4,
    "augment": True,       # random crop (padding 4) + horizontal flip
    "train_examples": 0,   # use the first N training examples (0 = all)
    "eval_examples": 1000,  # held-out examples for `veritrain eval`
    "init_seed": 0,
    "data_seed": 0,
}
RANGES = {"width": "[1, inf)", "batch_size": "[1, inf)", "lr": "[0, inf)", "momentum": "[0, inf)",
          "weight_decay": "[0, inf)", "train_examples": "[0, inf)", "eval_examples": "[1, inf)"}


def load_data(spec, digests: dict | None = None):
    if spec is None or spec == "":
        raise TaskError("resnet-cifar10: config 'data' is required: a path to cifar-10-python.tar.gz (or its "
                        "extracted folder), or 'digits' (--set data=digits)")
    if spec == "digits":
        return digits_as_cifar()
    return load_cifar10(spec, digests)


def augment(images: np.ndarray, seed: int, step: int) -> np.ndarray:
    """Random 32x32 crops of the 4-padded images, and horizontal flips, from (seed, step)."""
    n = len(images)
    offsets = randomness.integers(seed, step, 2 * n, 0, 9, domain="data/augment").reshape(n, 2)
    # a flip of its own with probability 1/2 (one draw in [0, 9) for all three flipped 4 of 9 images)
    flips = randomness.integers(seed, step, n, 0, 2, domain="data/augment/flip")
    padded = np.pad(images, ((0, 0), (0, 0), (4, 4), (4, 4)))
    out = np.empty_like(images)
    for i, ((dy, dx), flip) in enumerate(zip(offsets, flips)):
        crop = padded[i, :, dy:dy + 32, dx:dx + 32]
        out[i] = crop[:, :, ::-1] if flip else crop
    return out


def make_task(config: dict) -> Task:
    unknown = set(config) - set(DEFAULTS)
    if unknown:
        raise TaskError(f"resnet-cifar10: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **config}
    check_ranges("resnet-cifar10", cfg, RANGES)
    digests = {}  # scikit-learn's digits are part of the installed library: no file to commit to
    x_train, y_train, x_test, y_test = load_data(cfg["data"], digests)
    if int(cfg["train_examples"]) > 0:
        x_train, y_train = x_train[: int(cfg["train_examples"])], y_train[: int(cfg["train_examples"])]
    bs, seed = int(cfg["batch_size"]), int(cfg["data_seed"])
    if bs <= 0 or len(x_train) == 0:
        raise TaskError("resnet-cifar10: batch_size and train_examples leave no training data")
    builders = {"resnet18": resnet18, "resnet50": resnet50}
    if cfg["arch"] not in builders:
        raise TaskError(f"resnet-cifar10: config 'arch' must be one of {sorted(builders)}, got {cfg['arch']!r}")
    torch.manual_seed(int(cfg["init_seed"]))  # initial weights are committed in the first checkpoint
    model = builders[cfg["arch"]](num_classes=10, width=int(cfg["width"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=float(cfg["lr"]), momentum=float(cfg["momentum"]),
                                weight_decay=float(cfg["weight_decay"]))
    augment_on = str(cfg["augment"]).lower() not in ("false", "0", "no")
    n_eval = min(int(cfg["eval_examples"]), len(x_test))
    x_eval, y_eval = torch.from_numpy(normalize(x_test[:n_eval])), torch.from_numpy(y_test[:n_eval])

    def batch_indices(step: int):
        return randomness.epoch_order(seed, step, bs, len(x_train)).tolist()

    def batch(step: int):
        idx = np.asarray(batch_indices(step))
        images = augment(x_train[idx], seed, step) if augment_on else x_train[idx]
        return torch.from_numpy(normalize(images)), torch.from_numpy(y_train[idx])

    def loss(model, b):
        return F.cross_entropy(model(b[0]), b[1])

    def evaluate(model):
        was = model.training
        model.eval()
        correct, nll = 0, 0.0
        dev = current_device()
        with torch.no_grad():
            for i in range(0, n_eval, 250):
                logits = model(x_eval[i:i + 250].to(dev, next(model.parameters()).dtype))
                y = y_eval[i:i + 250].to(dev)
                correct += int((logits.argmax(1) == y).sum())
                nll += float(F.cross_entropy(logits.double(), y, reduction="sum"))
        model.train(was)
        return {"accuracy": correct / max(n_eval, 1), "loss": nll / max(n_eval, 1), "examples": n_eval}

    return Task(model=model, optimizer=optimizer, batch=batch, loss=loss, evaluate=evaluate,
                batch_indices=batch_indices, data_sha256=digests)


make_task.defaults = DEFAULTS
# the settings naming files (store.config_paths_inside); cifar.load_cifar10 reads a folder's batches folder
make_task.data_paths = {"data": {"words": ("digits",), "within": (FOLDER,)}}
