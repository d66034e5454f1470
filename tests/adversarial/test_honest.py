"""The other side of soundness: an honest run of every built-in task is still accepted, by an auditor with
the default policy, under every emulated CPU variant (digits-cnn and gpt2-text at length in
tests/test_cross_hardware.py; here the paper's two workloads, small, including fine-tuning from saved
weights, whose initial state the auditor rebuilds from its own copy of them)."""

import pytest

from conftest import audit_json, cli, shared_file

VARIANTS = ["isa-default", "isa-avx2", "onednn-avx2", "onednn-sse41", "mkl-compatible", "threads-1", "no-mkldnn",
            "combo"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shakespeare):
    from transformers import GPT2Config, GPT2LMHeadModel

    base = tmp_path_factory.mktemp("honest")
    GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_layer=1, n_embd=32, n_head=2, n_positions=64)).save_pretrained(
        base / "pretrained")
    gpt = ["--set", f"corpus={shakespeare}", "--set", f"tokenizer={shared_file('gpt2-tokenizer')}",
           "--set", "max_chars=20000", "--set", "batch_size=2", "--set", "seq_len=16"]
    specs = {
        "resnet-cifar10": ["--set", "data=digits", "--set", "width=4", "--set", "batch_size=4",
                           "--set", "train_examples=64", "--set", "eval_examples=16"],
        "gpt2-shakespeare": gpt + ["--set", "n_layer=1", "--set", "n_embd=32", "--set", "n_head=2"],
        "gpt2-shakespeare-pretrained": gpt + ["--set", f"pretrained={base / 'pretrained'}"],
    }
    out = {}
    for name, extra in specs.items():
        run = base / name
        cli("train", name.replace("-pretrained", ""), "--out", run, "--steps", 2, "--checkpoint-every", 1, "--quiet",
            *extra, check=0)
        out[name] = run
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet-cifar10", "gpt2-shakespeare", "gpt2-shakespeare-pretrained"])
def test_honest_runs_are_accepted_under_every_variant(runs, name):
    # the GPT-2 runs under the variants that change the most at once (every CPU knob together, and the
    # emulated accelerator); each knob alone is replayed at length in tests/test_cross_hardware.py
    for v in VARIANTS if name == "resnet-cifar10" else ["isa-default", "combo", "reorder"]:
        r = audit_json(runs[name], v)
        assert r["accepted"], f"{name} under {v}: {r['reasons']}"
        assert r["suspicious"] == 0 and all(c["match"] for c in r["checkpoints"])
