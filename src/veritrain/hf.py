"""Hugging Face ``transformers.Trainer``, made verifiable: its own training step as a veritrain Task.

    def make_task(config):                                  # mytask.py; `veritrain train mytask:make_task`
        model = GPT2LMHeadModel(GPT2Config(...))
        args = TrainingArguments(output_dir="hf-out", max_steps=100, per_device_train_batch_size=8,
                                 learning_rate=3e-4, report_to=[])
        return veritrain.hf.task(Trainer(model=model, args=args, train_dataset=dataset))

The step is the Trainer's: ``trainer.training_step`` (its forward, loss and backward, with your
``compute_loss`` override if any), gradient clipping at ``args.max_grad_norm``, the optimizer and the
learning-rate schedule the Trainer creates for ``args.max_steps``. What changes is the data order: batches
come from a step-indexed loader (veritrain.data.StepLoader, seeded by ``args.seed``) with the Trainer's
collator and batch size, so that an auditor can replay any interval; gradient accumulation, several
devices are refused; the fused AdamW the Trainer picks runs as its single-tensor implementation (veritrain runs one optimizer step per batch, single-process).
Built inside ``veritrain train``, the model's initialisation draws from veritrain's generator, so an
auditor on other hardware builds the same weights.
"""

from __future__ import annotations

import torch

from .task import Task, TaskError


def task(trainer, *, seed: int | None = None) -> Task:
    """A Task that trains ``trainer``'s model with ``trainer``'s own step, optimizer and schedule."""
    from .data import StepLoader

    args = trainer.args
    if args.max_steps is None or args.max_steps <= 0:
        raise TaskError("veritrain.hf.task: set TrainingArguments(max_steps=N): the optimizer's schedule is built for it")
    if args.gradient_accumulation_steps != 1:
        raise TaskError("veritrain.hf.task: gradient_accumulation_steps must be 1 (veritrain steps the optimizer "
                        "once per batch; use a larger per_device_train_batch_size)")
    if trainer.train_dataset is None:
        raise TaskError("veritrain.hf.task: the Trainer has no train_dataset")
    trainer.create_optimizer_and_scheduler(num_training_steps=args.max_steps)
    # the Trainer's default AdamW is the fused kernel, which differs by device: before its first step the
    # same optimizer can run its single-tensor implementation instead (same update rule)
    for group in trainer.optimizer.param_groups:
        if group.get("fused"):
            group["fused"] = False
    trainer.optimizer.defaults.pop("fused", None)
    dataset = trainer.train_dataset
    if hasattr(dataset, "column_names") and hasattr(trainer, "_remove_unused_columns"):  # as the Trainer's own
        # loader does for a datasets.Dataset
        dataset = trainer._remove_unused_columns(dataset, description="training")
    loader = StepLoader(dataset, args.per_device_train_batch_size, seed=args.seed if seed is None else seed,
                        shuffle=True, drop_last=args.dataloader_drop_last, collate_fn=trainer.data_collator)
    clip = args.max_grad_norm
    trainer.current_gradient_accumulation_steps = 1  # what Trainer.train() would set for training_step

    def train_step(model, optimizer, batch):
        loss = trainer.training_step(model, batch)  # forward, loss, backward: the Trainer's own
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        model.zero_grad(set_to_none=True)
        return loss

    return Task(model=trainer.model, optimizer=trainer.optimizer, batch=loader.batch, train_step=train_step,
                scheduler=trainer.lr_scheduler, batch_indices=loader.indices)
