"""The digits CNN, whose process dies abruptly: with VERITRAIN_TEST_KILL_AT=K set, the process of rank
VERITRAIN_TEST_KILL_RANK (default 1) that computes batch(K) kills itself with SIGKILL (a machine lost in
the middle of a data-parallel run). With VERITRAIN_TEST_SLOW_COMMIT=SECONDS set, rank 0 takes that long to
commit each checkpoint's manifest (a slow disk). Without the variables it is the plain task."""

import os
import signal
import time

from veritrain import store

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
    slow = os.environ.get("VERITRAIN_TEST_SLOW_COMMIT")
    if slow is not None and os.environ.get("RANK") == "0" and not hasattr(store.save_manifest, "slowed"):
        save = store.save_manifest

        def slow_save(run_dir, manifest):
            time.sleep(float(slow))
            save(run_dir, manifest)

        slow_save.slowed = True
        store.save_manifest = slow_save
    return task


make_task.defaults = DEFAULTS
