"""The paper's language workload: Hugging Face GPT2LMHeadModel (117M by default) fine-tuned on a corpus
(tiny Shakespeare), batch 8 x 64 tokens, AdamW with a linear learning-rate schedule, dropout on.

Weights come from ``pretrained`` (a local folder saved with ``save_pretrained``, or a hub name when a hub
is reachable) or, without it, from the config. Tokens are GPT-2's BPE from ``tokenizer`` (a folder with
vocab.json/encoder.json and merges.txt/vocab.bpe, or a hub name). Training windows are contiguous
``seq_len + 1`` tokens of the corpus: the model sees the first ``seq_len`` and is scored on the next
token at each position (labels shifted once, here, not again inside the model), and no window holds
padding. The loss is computed here on the model's float32 logits.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F

from veritrain import randomness
from veritrain.task import Task, TaskError, check_ranges, current_device
from veritrain.tasks.gpt2_text import RANGES as TEXT_RANGES, check_heads, load_bpe_tokenizer, read_corpus

DEFAULTS = {
    "corpus": None,        # path to a text file (required)
    "tokenizer": None,     # folder with GPT-2's BPE files, or a hub name (required)
    "pretrained": None,    # folder or hub name of GPT-2 weights; absent = initialise from the config
    "n_layer": 12,
    "n_embd": 768,
    "n_head": 12,
    "batch_size": 8,
    "seq_len": 64,
    "lr": 5e-5,
    "weight_decay": 0.0,
    "warmup_steps": 0,
    "schedule_steps": 1000,  # the linear schedule decays to 0 over this many optimizer steps
    "dropout": 0.1,
    "max_chars": 0,        # read at most this many characters of the corpus (0 = all)
    "held_out_fraction": 0.1,
    "eval_windows": 64,
    "init_seed": 0,
    "data_seed": 0,
}
RANGES = {**{k: v for k, v in TEXT_RANGES.items() if k in DEFAULTS}, "warmup_steps": "[0, inf)",
          "schedule_steps": "[1, inf)", "eval_windows": "[1, inf)"}


def load_tokenizer(spec, digests: dict | None = None):
    if not spec:
        raise TaskError("gpt2-shakespeare: config 'tokenizer' is required: a folder with GPT-2's vocab/merges "
                        "files (e.g. --set tokenizer=../shared/data/gpt2-tokenizer) or a hub name")
    spec = os.path.expanduser(str(spec))
    if os.path.isdir(spec):
        return load_bpe_tokenizer(spec, digests)
    if os.path.sep in spec or spec.startswith("."):
        raise TaskError(f"config 'tokenizer': {spec!r} does not exist")
    from transformers import GPT2TokenizerFast

    try:
        return GPT2TokenizerFast.from_pretrained(spec)
    except Exception as e:  # noqa: BLE001 - no hub, unknown name: say so
        raise TaskError(f"config 'tokenizer': {spec!r} is not a folder and could not be loaded from a hub "
                        f"({type(e).__name__})") from None


def load_model(cfg: dict, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    p = float(cfg["dropout"])
    spec = cfg["pretrained"]
    if spec:
        spec = os.path.expanduser(str(spec))
        if not os.path.isdir(spec) and (os.path.sep in spec or spec.startswith(".")):
            raise TaskError(f"config 'pretrained': {spec!r} does not exist")
        try:
            model = GPT2LMHeadModel.from_pretrained(spec, resid_pdrop=p, embd_pdrop=p, attn_pdrop=p,
                                                    attn_implementation="eager")
        except Exception as e:  # noqa: BLE001 - corrupt folder, no hub: name it
            raise TaskError(f"config 'pretrained': cannot load GPT-2 weights from {spec!r} ({type(e).__name__}: "
                            f"{str(e)[:200]})") from None
        if model.config.vocab_size < vocab:
            raise TaskError(f"config 'pretrained': the model's vocabulary ({model.config.vocab_size}) is smaller "
                            f"than the tokenizer's ({vocab})")
        return model
    gcfg = GPT2Config(vocab_size=vocab, n_positions=max(int(cfg["seq_len"]), 1024), n_embd=int(cfg["n_embd"]),
                      n_layer=int(cfg["n_layer"]), n_head=int(cfg["n_head"]), resid_pdrop=p, embd_pdrop=p,
                      attn_pdrop=p, bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    gcfg._attn_implementation = "eager"
    return GPT2LMHeadModel(gcfg)


def linear_schedule(optimizer, warmup: int, total: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return max(0.0, (total - step) / max(1, total - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_task(config: dict) -> Task:
    unknown = set(config) - set(DEFAULTS)
    if unknown:
        raise TaskError(f"gpt2-shakespeare: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **config}
    check_ranges("gpt2-shakespeare", cfg, RANGES)
    check_heads("gpt2-shakespeare", cfg)
    digests = {}
    text = read_corpus(cfg["corpus"], int(cfg["max_chars"]), digests)
    tok = load_tokenizer(cfg["tokenizer"], digests)
    tokens = np.asarray(tok(text, add_special_tokens=False)["input_ids"], dtype=np.int64)
    seq, bs = int(cfg["seq_len"]), int(cfg["batch_size"])
    n_test = int(len(tokens) * float(cfg["held_out_fraction"]))
    train_tokens = torch.from_numpy(tokens[: len(tokens) - n_test])
    test_tokens = torch.from_numpy(tokens[len(tokens) - n_test:])
    if len(train_tokens) <= seq + 1:
        raise TaskError(f"gpt2-shakespeare: the corpus has {len(train_tokens)} training tokens, fewer than seq_len+2")

    torch.manual_seed(int(cfg["init_seed"]))  # initial weights are committed in the first checkpoint
    model = load_model(cfg, len(tok))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(cfg["lr"]), weight_decay=float(cfg["weight_decay"]))
    scheduler = linear_schedule(optimizer, int(cfg["warmup_steps"]), int(cfg["schedule_steps"]))
    seed = int(cfg["data_seed"])

    def batch_indices(step: int):
        return randomness.integers(seed, step, bs, 0, len(train_tokens) - seq - 1).tolist()

    def batch(step: int):
        return torch.stack([train_tokens[s: s + seq + 1] for s in batch_indices(step)])

    def lm_loss(model, ids):
        logits = model(input_ids=ids[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    def evaluate(model):
        was = model.training
        model.eval()
        n = min(int(cfg["eval_windows"]), (len(test_tokens) - 1) // seq)
        windows = [test_tokens[i * seq: i * seq + seq + 1].to(current_device()) for i in range(n)]
        if not windows:
            return {}
        with torch.no_grad():
            nll = sum(lm_loss(model, torch.stack(windows[i:i + 8])).item() * len(windows[i:i + 8])
                      for i in range(0, n, 8)) / n
        model.train(was)
        return {"loss": nll, "perplexity": float(np.exp(nll)), "windows": n}

    return Task(model=model, optimizer=optimizer, batch=batch, loss=lm_loss, scheduler=scheduler,
                evaluate=evaluate, batch_indices=batch_indices, data_sha256=digests)


make_task.defaults = DEFAULTS
# the settings naming files (store.config_paths_inside; a hub name that is an existing folder is read as one):
# pretrained weights shipped in the run folder would be the trainer's choice of initial state
make_task.data_paths = {"corpus": {}, "tokenizer": {}, "pretrained": {}}
