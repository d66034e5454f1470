"""A small GPT-2-style language model (Hugging Face GPT2LMHeadModel built from a config) on a text file.

The causal LM loss is computed here, on the model's float32 logits: ``transformers``' built-in loss
casts logits to float32 itself, which is not an op we want hidden inside the model. Tokens are either
raw bytes (vocabulary 256) or GPT-2's byte-level BPE from a folder holding its vocabulary and merges.
"""

from __future__ import annotations

import io
import os
import stat

import numpy as np
import torch
import torch.nn.functional as F

from veritrain import randomness
from veritrain.commitments import data_hash
from veritrain.task import Task, TaskError, check_ranges, current_device

DEFAULTS = {
    "corpus": None,       # path to a UTF-8 text file (required)
    "tokenizer": "bytes",  # "bytes", or a folder with GPT-2's encoder.json/vocab.json and vocab.bpe/merges.txt
    "max_chars": 200_000,  # read at most this many characters of the corpus (0 = all)
    "n_layer": 2,
    "n_embd": 128,
    "n_head": 4,
    "seq_len": 64,
    "batch_size": 8,
    "dropout": 0.1,
    "optimizer": "adamw",  # or "sgd" (momentum 0.9)
    "lr": 1e-3,
    "weight_decay": 0.01,
    "clip_grad_norm": 0.0,  # > 0: clip with torch.nn.utils.clip_grad_norm_ (uses train_step)
    "init_seed": 0,
    "data_seed": 0,
    "held_out_fraction": 0.1,
}
RANGES = {"max_chars": "[0, inf)", "n_layer": "[1, inf)", "n_embd": "[1, inf)", "n_head": "[1, inf)",
          "seq_len": "[1, inf)", "batch_size": "[1, inf)", "dropout": "[0, 1)", "lr": "[0, inf)",
          "weight_decay": "[0, inf)", "clip_grad_norm": "[0, inf)", "held_out_fraction": "(0, 1)"}


def check_heads(task: str, cfg: dict):
    if int(cfg["n_embd"]) % int(cfg["n_head"]):
        raise TaskError(f"{task}: config 'n_embd' ({cfg['n_embd']}) is not a multiple of 'n_head' ({cfg['n_head']})")


MAX_CORPUS_BYTES = 1 << 30
MAX_TOKENIZER_FILE_BYTES = 1 << 26  # GPT-2's vocab.json has 1 MB, merges.txt 0.5 MB


def read_corpus(path, max_chars: int, digests: dict | None = None) -> str:
    """The corpus's first ``max_chars`` characters (0: all); ``digests["corpus"]``, where given, the whole
    file's data hash (commitments.data_hash), which a run commits to (Task.data_sha256)."""
    if not path:
        raise TaskError("gpt2-text: config 'corpus' is required (a path to a text file, e.g. "
                        "--set corpus=../shared/data/shakespeare.txt)")
    path = os.path.expanduser(str(path))
    try:
        # a run's config names the file: a regular one (not a FIFO or a device, opened without blocking) of at
        # most MAX_CORPUS_BYTES, so a hostile path can neither hang the auditor nor fill its memory
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as raw:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise TaskError(f"gpt2-text: corpus {path!r} (config 'corpus') is not a regular file")
            if st.st_size > MAX_CORPUS_BYTES:
                raise TaskError(f"gpt2-text: corpus {path!r} (config 'corpus') has {st.st_size} bytes, more than "
                                f"{MAX_CORPUS_BYTES}")
            os.set_blocking(fd, True)
            data = raw.read(MAX_CORPUS_BYTES + 1)
        if len(data) > MAX_CORPUS_BYTES:  # it grew after it was opened
            raise TaskError(f"gpt2-text: corpus {path!r} (config 'corpus') has more than {MAX_CORPUS_BYTES} bytes")
        if digests is not None:
            digests["corpus"] = data_hash([("corpus", data)])
        with io.TextIOWrapper(io.BytesIO(data), encoding="utf-8") as f:
            text = f.read(max_chars) if max_chars else f.read()
    except FileNotFoundError:
        raise TaskError(f"gpt2-text: corpus file {path!r} (config 'corpus') does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError(f"gpt2-text: cannot read corpus {path!r} (config 'corpus'): {e}") from None
    if not text:
        raise TaskError(f"gpt2-text: corpus {path!r} is empty")
    return text


def load_bpe_tokenizer(folder, digests: dict | None = None):
    """GPT-2's BPE from a folder; ``digests["tokenizer"]``, where given, the data hash of its two files."""
    from transformers import GPT2TokenizerFast

    folder = os.path.expanduser(str(folder))
    if not os.path.isdir(folder):
        raise TaskError(f"config 'tokenizer': {folder!r} is not a folder with GPT-2 tokenizer files "
                        f"(or use tokenizer=bytes)")
    vocab = next((os.path.join(folder, n) for n in ("vocab.json", "encoder.json")
                  if os.path.exists(os.path.join(folder, n))), None)
    merges = next((os.path.join(folder, n) for n in ("merges.txt", "vocab.bpe")
                   if os.path.exists(os.path.join(folder, n))), None)
    if vocab is None or merges is None:
        raise TaskError(f"config 'tokenizer': {folder!r} lacks vocab.json/encoder.json or merges.txt/vocab.bpe")
    for path in (vocab, merges):  # read whole by the tokenizer library: as the corpus, small regular files only
        st = os.stat(path)  # follows a symlink, does not open (a FIFO would block)
        if not stat.S_ISREG(st.st_mode):
            raise TaskError(f"config 'tokenizer': {path!r} is not a regular file")
        if st.st_size > MAX_TOKENIZER_FILE_BYTES:
            raise TaskError(f"config 'tokenizer': {path!r} has {st.st_size} bytes, more than {MAX_TOKENIZER_FILE_BYTES}")
    if digests is not None:
        parts = []
        for part, path in (("vocab", vocab), ("merges", merges)):
            with open(path, "rb") as f:
                parts.append((part, f.read(MAX_TOKENIZER_FILE_BYTES + 1)))
        digests["tokenizer"] = data_hash(parts)
    try:
        try:  # transformers >= 5 takes the files as vocab=/merges= (vocab_file= is silently ignored)
            tok = GPT2TokenizerFast(vocab=vocab, merges=merges)
        except TypeError:
            tok = GPT2TokenizerFast(vocab_file=vocab, merges_file=merges)
        if len(tok) < 257:
            tok = GPT2TokenizerFast(vocab_file=vocab, merges_file=merges)
    except Exception as e:  # a corrupt file: name it
        raise TaskError(f"config 'tokenizer': cannot load GPT-2 BPE files from {folder!r}: {e}") from None
    if len(tok) < 257 or not tok("a b", add_special_tokens=False)["input_ids"]:
        raise TaskError(f"config 'tokenizer': the files in {folder!r} load as an empty or broken vocabulary "
                        f"({len(tok)} tokens)")
    return tok


def tokenize(text: str, tokenizer: str, digests: dict | None = None):
    if tokenizer == "bytes":
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64), 256
    tok = load_bpe_tokenizer(tokenizer, digests)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return np.asarray(ids, dtype=np.int64), len(tok)


def make_task(config: dict) -> Task:
    from transformers import GPT2Config, GPT2LMHeadModel

    unknown = set(config) - set(DEFAULTS)
    if unknown:
        raise TaskError(f"gpt2-text: unknown config keys {sorted(unknown)}; known: {sorted(DEFAULTS)}")
    cfg = {**DEFAULTS, **config}
    check_ranges("gpt2-text", cfg, RANGES)
    check_heads("gpt2-text", cfg)
    digests = {}
    text = read_corpus(cfg["corpus"], int(cfg["max_chars"]), digests)
    tokens, vocab = tokenize(text, str(cfg["tokenizer"]), digests)
    seq, bs = int(cfg["seq_len"]), int(cfg["batch_size"])
    n_test = int(len(tokens) * float(cfg["held_out_fraction"]))
    train_tokens, test_tokens = torch.from_numpy(tokens[: len(tokens) - n_test]), torch.from_numpy(tokens[len(tokens) - n_test:])
    if len(train_tokens) <= seq + 1:
        raise TaskError(f"gpt2-text: the corpus has {len(train_tokens)} training tokens, fewer than seq_len+2")

    gcfg = GPT2Config(vocab_size=vocab, n_positions=max(seq, 64), n_embd=int(cfg["n_embd"]),
                      n_layer=int(cfg["n_layer"]), n_head=int(cfg["n_head"]), resid_pdrop=float(cfg["dropout"]),
                      embd_pdrop=float(cfg["dropout"]), attn_pdrop=float(cfg["dropout"]),
                      bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    gcfg._attn_implementation = "eager"
    torch.manual_seed(int(cfg["init_seed"]))
    model = GPT2LMHeadModel(gcfg)
    model.train()
    lr, wd = float(cfg["lr"]), float(cfg["weight_decay"])
    if cfg["optimizer"] == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd)
    elif cfg["optimizer"] == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=wd)
    else:
        raise TaskError(f"gpt2-text: config 'optimizer' must be 'adamw' or 'sgd', got {cfg['optimizer']!r}")
    seed = int(cfg["data_seed"])

    def batch_indices(step: int):
        return randomness.integers(seed, step, bs, 0, len(train_tokens) - seq - 1).tolist()

    def batch(step: int):
        starts = batch_indices(step)
        return torch.stack([train_tokens[s: s + seq + 1] for s in starts])

    def lm_loss(model, ids):
        logits = model(input_ids=ids[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

    clip = float(cfg["clip_grad_norm"])

    def train_step(model, optimizer, ids):
        optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(model, ids)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        return loss

    def evaluate(model, max_windows: int = 64):
        was = model.training
        model.eval()
        n = min(max_windows, max(1, (len(test_tokens) - 1) // seq))
        windows = [test_tokens[i * seq: i * seq + seq + 1] for i in range(n) if i * seq + seq + 1 <= len(test_tokens)]
        if not windows:
            return {}
        with torch.no_grad():
            nll = lm_loss(model, torch.stack(windows).to(current_device())).item()
        model.train(was)
        return {"loss": nll, "perplexity": float(np.exp(nll)), "windows": len(windows)}

    if clip > 0:
        return Task(model=model, optimizer=optimizer, batch=batch, train_step=train_step, evaluate=evaluate,
                    batch_indices=batch_indices, data_sha256=digests)
    return Task(model=model, optimizer=optimizer, batch=batch, loss=lm_loss, evaluate=evaluate,
                batch_indices=batch_indices, data_sha256=digests)


make_task.defaults = DEFAULTS
make_task.data_paths = {"corpus": {}, "tokenizer": {"words": ("bytes",)}}  # the settings naming files (store.config_paths_inside)
