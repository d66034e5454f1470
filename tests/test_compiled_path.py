"""Every built-in task trained with the compiled kernels forced on for every tensor (VERITRAIN_COMPILE=1:
fused elementwise ops, compiled sums, the round-and-scan epilogues) and with eager float64 ops only
(VERITRAIN_COMPILE=0) gives the same run: the same root, so the same checkpoint states, data records and log
bytes (each record holds its log's SHA-256), and the logs themselves compared byte for byte."""

import pytest

from conftest import cli, shared_file
from veritrain import store

TASKS = {
    "digits-cnn": [],
    "gpt2-text": ["--set", "n_layer=2", "--set", "n_embd=64", "--set", "n_head=4", "--set", "seq_len=32",
                  "--set", "batch_size=4", "--set", "max_chars=20000"],
    "resnet-cifar10": ["--set", "data=digits", "--set", "width=8", "--set", "batch_size=16"],
    # the GPT-2 vocabulary (50257): the vocabulary-wide sums and the NLL loss at full size
    "gpt2-shakespeare": ["--set", "n_layer=1", "--set", "n_embd=32", "--set", "n_head=2", "--set", "seq_len=16",
                         "--set", "batch_size=2", "--set", "max_chars=20000"],
}
STEPS, EVERY = 2, 1


@pytest.mark.parametrize("task", sorted(TASKS))
def test_a_task_trains_to_the_same_run_compiled_and_eager(tmp_path, task, shakespeare):
    settings = list(TASKS[task])
    if task.startswith("gpt2"):
        settings += ["--set", f"corpus={shakespeare}"]
    if task == "gpt2-shakespeare":
        settings += ["--set", f"tokenizer={shared_file('gpt2-tokenizer')}"]
    runs = {}
    for mode in ("1", "0"):
        runs[mode] = tmp_path / f"compile-{mode}"
        cli("train", task, "--out", runs[mode], "--steps", STEPS, "--checkpoint-every", EVERY, "--quiet", *settings,
            env={"VERITRAIN_COMPILE": mode}, check=0)
    compiled, eager = (store.load_manifest(str(runs[m])) for m in ("1", "0"))
    assert compiled["root"] == eager["root"]
    assert [c["state_sha256"] for c in compiled["checkpoints"]] == [c["state_sha256"] for c in eager["checkpoints"]]
    for s in range(STEPS):
        name = store.log_name(s)
        assert (runs["1"] / name).read_bytes() == (runs["0"] / name).read_bytes(), name
