"""The digits CNN, with a dishonest data pipeline: when VERITRAIN_TEST_POISON_STEP=S is set, step S trains
on altered images (the trainer and its prover run with it; an honest auditor does not). The task's source
is the same on both sides, so only the data differs."""

import os

from veritrain.tasks.digits_cnn import DEFAULTS, make_task as make_digits  # noqa: F401


def make_task(config):
    task = make_digits(config)
    honest = task.batch
    poison = os.environ.get("VERITRAIN_TEST_POISON_STEP")

    def batch(step):
        x, y = honest(step)
        if poison is not None and step == int(poison):
            x = x.clone()
            x[0] = -x[0]  # one poisoned example
        return x, y

    task.batch = batch
    return task


make_task.defaults = DEFAULTS
