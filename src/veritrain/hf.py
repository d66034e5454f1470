"""Hugging Face ``transformers.Trainer``, made verifiable, two ways.

``veritrain.hf.Trainer`` is a ``transformers.Trainer`` whose ``train()`` is a verifiable run of your own
script (veritrain.Run): the trainer writes the run folder, and the same script audits it
(``veritrain audit RUN -- python train.py``) or plays the verification game (``veritrain dispute`` /
``veritrain serve`` with ``-- python train.py``):

    with veritrain.init(seed=0) as init:                    # the same initial weights on every machine
        model = GPT2LMHeadModel(GPT2Config(...))
    trainer = veritrain.hf.Trainer(model=model, args=args, train_dataset=dataset,
                                   run_dir="runs/a", checkpoint_every=100, init=init)
    trainer.train()

``veritrain.hf.task(trainer)`` makes a Trainer a Task, for ``veritrain train mytask:make_task``:

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
devices are refused; the fused AdamW the Trainer picks runs as its foreach implementation (veritrain runs one
optimizer step per batch, single-process).
Built inside ``veritrain train``, the model's initialisation draws from veritrain's generator, so an
auditor on other hardware builds the same weights.
"""

from __future__ import annotations

import torch
import transformers

from .task import Task, TaskError

# the TrainingArguments that decide the training (recorded in the run's config, compared by the auditor);
# output and logging paths, which hold dates and host names, are not among them. Everything the step reads is:
# a setting left out (label smoothing, which the Trainer's compute_loss applies) let a run trained with it
# pass a contract pinning the config of a run without it
RECORDED_ARGS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
                 "max_steps", "per_device_train_batch_size", "lr_scheduler_type", "lr_scheduler_kwargs",
                 "warmup_steps", "warmup_ratio", "optim", "optim_args", "optim_target_modules", "seed",
                 "dataloader_drop_last", "label_smoothing_factor", "label_names", "remove_unused_columns",
                 "gradient_accumulation_steps")


class Trainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose ``train()`` is a verifiable run (module docstring). ``run_dir``: the
    run folder (a killed run there resumes when the script runs again); ``checkpoint_every``, ``bits``,
    ``mode``, ``init`` (what ``veritrain.init`` yielded), ``thresholds`` and ``config`` (more settings to
    record) are ``veritrain.Run``'s. The step is the Trainer's (see ``task``)."""

    def __init__(self, *args, run_dir: str, checkpoint_every: int = 100, bits: int = 32, mode: str = "verified",
                 init=None, thresholds: dict | None = None, config: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.veritrain_options = {"run_dir": run_dir, "checkpoint_every": checkpoint_every, "bits": bits,
                                  "mode": mode, "init": init, "thresholds": thresholds, "config": dict(config or {})}
        self.veritrain_run = None

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """Train (or, under ``veritrain audit``/``dispute``/``serve``, replay) for ``args.max_steps`` steps;
        returns a TrainOutput whose metrics hold the run's root (or the audit's verdict)."""
        from transformers.trainer_utils import TrainOutput

        from .loop import Run

        if resume_from_checkpoint or trial is not None:
            raise TaskError("veritrain.hf.Trainer.train(): a killed run resumes from its run folder when the script "
                            "runs again; resume_from_checkpoint and hyperparameter search are not supported")
        o = self.veritrain_options
        loader, train_step = _parts(self, None)
        recorded = {k: _json_value(getattr(self.args, k)) for k in RECORDED_ARGS if hasattr(self.args, k)}
        run = Run(o["run_dir"], self.model, self.optimizer, scheduler=self.lr_scheduler, seed=self.args.seed,
                  checkpoint_every=o["checkpoint_every"], bits=o["bits"], mode=o["mode"], init=o["init"],
                  thresholds=o["thresholds"], config={"training_args": recorded, **o["config"]})
        self.veritrain_run = run
        losses = []
        for step, batch in run.steps(loader, self.args.max_steps):
            with run.step(batch) as s:
                s.loss = train_step(self.model, self.optimizer, batch)
                self.lr_scheduler.step()
            if isinstance(s.loss, torch.Tensor):
                losses.append(float(s.loss.detach()))
        self.state.global_step = self.args.max_steps
        result = run.result if run.result is not None else {"root": getattr(run, "root", None)}
        metrics = result.as_dict() if hasattr(result, "as_dict") else dict(result)
        return TrainOutput(self.args.max_steps, sum(losses) / len(losses) if losses else 0.0, metrics)


def _json_value(v):
    import json

    try:
        json.dumps(v)
        return v
    except (TypeError, ValueError):
        return str(v)


def task(trainer, *, seed: int | None = None) -> Task:
    """A Task that trains ``trainer``'s model with ``trainer``'s own step, optimizer and schedule."""
    loader, train_step = _parts(trainer, seed)
    return Task(model=trainer.model, optimizer=trainer.optimizer, batch=loader.batch, train_step=train_step,
                scheduler=trainer.lr_scheduler, batch_indices=loader.indices)


def _parts(trainer, seed):
    """(a StepLoader over the Trainer's dataset, the Trainer's step as train_step(model, optimizer, batch)),
    after the Trainer built its optimizer and schedule for args.max_steps."""
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
    # same optimizer can run its foreach implementation instead (same update rule; task.normalize_optimizer)
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

    return loader, train_step
