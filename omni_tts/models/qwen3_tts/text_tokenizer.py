"""Qwen2 byte-level BPE text tokenizer, built explicitly so the pre-tokenizer is always the Qwen2 regex.

The reference's loader can swap in Mistral's regex under some transformers versions (`iPhone` → `i`, `Phone`,
model doc §13); building the pipeline by hand from vocab.json + merges.txt rules that out.
"""
from __future__ import annotations

import gzip
import json
import os
import shutil
from importlib import resources

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from .checkpoint_config import ConfigError, read_json

QWEN2_PRETOKENIZE_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
_ASSETS = {"vocab.json": "qwen2_vocab.json.gz", "merges.txt": "qwen2_merges.txt.gz"}
SPECIAL_TOKENS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
# the target text's template (model doc §6): of its ids, the first TEMPLATE_HEAD_TOKENS are the role and the last
# TEMPLATE_TAIL_TOKENS are never used; the text tokens lie between
TEMPLATE_HEAD, TEMPLATE_TAIL = "<|im_start|>assistant\n", "<|im_end|>\n<|im_start|>assistant\n"
TEMPLATE_HEAD_TOKENS, TEMPLATE_TAIL_TOKENS = 3, 5
EMPTY_INPUT = "input text is empty"


def split_template(ids: list[int], closed: bool = True) -> tuple[list[int], list[int]]:
    """The target text template's ids as (role ids, text ids); closed: the template's tail is there (dropped).
    A text that arrives in pieces is split open: its ids so far, the tail not yet tokenized."""
    end = len(ids) - TEMPLATE_TAIL_TOKENS if closed else len(ids)
    return ids[:TEMPLATE_HEAD_TOKENS], ids[TEMPLATE_HEAD_TOKENS:end]


def strip_leading_newlines(text: str) -> str:
    """A leading newline of the target text would merge with the role's newline and shift the slices."""
    return text.lstrip("\r\n")


def load_text_tokenizer(model_dir: str) -> Tokenizer:
    for name in TOKENIZER_FILES:
        if not os.path.isfile(os.path.join(model_dir, name)):
            raise ConfigError(f"{os.path.join(model_dir, name)}: file not found (the text tokenizer needs "
                              f"{', '.join(TOKENIZER_FILES)})")
    tok = Tokenizer(models.BPE.from_file(os.path.join(model_dir, "vocab.json"), os.path.join(model_dir, "merges.txt")))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    config_path = os.path.join(model_dir, "tokenizer_config.json")
    added = read_json(config_path).get("added_tokens_decoder", {})
    for token_id, spec in sorted(added.items(), key=lambda kv: int(kv[0])):
        tok.add_special_tokens([AddedToken(spec["content"], special=True, normalized=False)])
        if tok.token_to_id(spec["content"]) != int(token_id):
            raise ConfigError(f"{config_path}: added token {spec['content']!r} must have id "
                              f"{tok.token_to_id(spec['content'])}, the file says {token_id}")
    return tok


def write_text_tokenizer_files(out_dir: str, special_tokens: dict[str, int] | None = None,
                               extra_config: dict | None = None) -> None:
    """Write the real 151,643-rank Qwen2 vocab/merges (shipped with the package) and a tokenizer_config.json whose
    added tokens are `special_tokens` (default: the TTS checkpoints' three), ids from 151643 without a gap."""
    os.makedirs(out_dir, exist_ok=True)
    assets = resources.files(__package__) / "assets"
    for name, asset in _ASSETS.items():
        with gzip.open(str(assets / asset), "rb") as src, open(os.path.join(out_dir, name), "wb") as dst:
            shutil.copyfileobj(src, dst)
    config = {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": {str(i): {"content": c, "single_word": False, "lstrip": False, "rstrip": False,
                                          "normalized": False, "special": True} for c, i in (special_tokens or SPECIAL_TOKENS).items()},
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
        "model_max_length": 131072, "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    } | (extra_config or {})
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=2)
        f.write("\n")
