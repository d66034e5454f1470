"""The digits CNN, whose process dies abruptly: with VERITRAIN_TEST_KILL_AT=K set, the process of rank
VERITRAIN_TEST_KILL_RANK (default 1) that computes batch(K) kills itself with SIGKILL (a machine lost in
the middle of a data-parallel run). Without the variable it is the plain task."""

import os
import signal

from veritrain.tasks.digits_cnn import DEFAULTS, make_task as make_digits  # noqa: F401


def make_task(config):
    task = make_digits(config)
    honest = task.batch
    kill_at = os.environ.get("VERITRAIN_TEST_KILL_AT")
    rank = os.environ.get("VERITRAIN_TEST_KILL_RANK", "1")

    def batch(k):
        if kill_at is not None and k == int(kill_at) and os.environ.get("RANK") == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return honest(k)

    task.batch = batch
    return task


make_task.defaults = DEFAULTS
