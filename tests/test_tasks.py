"""Built-in tasks' data loading: tokenizer files, corpus errors."""

import json

import pytest

from conftest import shared_file
from veritrain.task import TaskError
from veritrain.tasks.gpt2_text import load_bpe_tokenizer, tokenize


def test_gpt2_bpe_from_the_shared_files():
    folder = shared_file("gpt2-tokenizer")
    tok = load_bpe_tokenizer(folder)
    assert len(tok) == 50257
    assert tok("Hello world", add_special_tokens=False)["input_ids"] == [15496, 995]
    ids, vocab = tokenize("Hello world", folder)
    assert ids.tolist() == [15496, 995] and vocab == 50257


def test_a_small_bpe_in_gpt2_format(tmp_path):
    """vocab.json + merges.txt in GPT-2's format (byte-level symbols), made here."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab["ab"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    tok = load_bpe_tokenizer(str(tmp_path))
    assert tok("abc", add_special_tokens=False)["input_ids"] == [vocab["ab"], vocab["c"]]


def test_broken_tokenizer_files_are_named(tmp_path):
    (tmp_path / "vocab.json").write_text("{}")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(TaskError, match="empty or broken vocabulary|cannot load"):
        load_bpe_tokenizer(str(tmp_path))
    (tmp_path / "vocab.json").write_text("not json")
    with pytest.raises(TaskError, match=str(tmp_path)):
        load_bpe_tokenizer(str(tmp_path))
