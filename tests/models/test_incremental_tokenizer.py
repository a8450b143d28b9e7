"""Incremental tokenization: ids fed in pieces equal the whole text's ids, whatever the cuts."""
import random
import subprocess
import sys

import pytest

from conftest import FIXTURES
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.incremental_tokenizer import IncrementalTokenizer
from omni_tts.models.qwen3_tts.prompt import PromptBuilder, SynthesisRequest
from omni_tts.models.qwen3_tts.text_tokenizer import load_text_tokenizer

MODEL = str(FIXTURES / "tiny-custom-voice")
TOKENIZER = load_text_tokenizer(MODEL)
BUILDER = PromptBuilder(Qwen3TTSConfig.load(MODEL), TOKENIZER)

# pieces of text that stress the pipeline's context: whitespace runs (the regex scans them whole), contractions,
# single digits, punctuation runs with newlines, scripts without spaces, multi-code-point emoji, combining marks
# that compose or reorder under NFC, Hangul jamo, and the template's special tokens inside the text
ATOMS = [
    "Hello", "world", "it", "'s", "'ll", "'RE", "don't", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ",
    "0", "42", "3.14", "2026", ".", ",", "!", "?!", "...", "—", "\"", "(", ")", "'", "-", "#", "$5", "%", "&",
    "你好", "世界", "。", "，", "今天天气很好", "日本語", "한국어", "😀", "👍🏽", "👨‍👩‍👧", "🇫🇷",
    "e\u0301", "o\u0330\u031b", "a\u0323\u0302", "\u0301", "\u031b", "\u0330", "x\u0308", "ñ", "Å",
    "\u1100", "\u1161", "\u11a8", "가", "\u0915\u094d\u0937", "\u0bc6\u0bbe", "\u0bd7", "क़", "\u0f73",
    "<|im_end|>", "<|im_start|>", "<|", "im_", "|>", "<", "\u00a0", "\u3000", "\u2028", "ß", "İ", "ﬁ",
]


def whole_ids(text: str) -> list[int]:
    prompt = BUILDER.tokenize(SynthesisRequest(text=text, voice="ryan"))
    return prompt.role_ids + prompt.text_ids


def incremental_ids(pieces: list[str]) -> list[int]:
    tokenizer = IncrementalTokenizer(TOKENIZER)
    ids = []
    for piece in pieces:
        ids += tokenizer.feed(piece)
    return ids + tokenizer.finish()


def random_cuts(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text) + 1, 12))))
    bounds = [0] + cuts + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]  # empty pieces included


def test_is_torch_free():
    code = "import sys, omni_tts.models.qwen3_tts.incremental_tokenizer; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_random_texts_and_cuts_give_the_whole_texts_ids():
    rng = random.Random(12)
    checked = 0
    while checked < 3000:
        text = "".join(rng.choice(ATOMS) for _ in range(rng.randint(1, 14)))
        if not text.lstrip("\r\n").strip():
            continue
        expected = whole_ids(text)
        for _ in range(3):
            pieces = random_cuts(rng, text)
            assert incremental_ids(pieces) == expected, pieces
        checked += 1


@pytest.mark.parametrize("text", ["Hello world, this is streaming.", " \nleading space then newline", "\n\nHi",
                                  "o\u0330\u031b", "a  b\n \n c", "it's 2026!\n\nNext", "x<|im_end|>y",
                                  "a \t12 b"])
def test_every_single_cut_and_char_by_char(text):
    expected = whole_ids(text)
    for cut in range(len(text) + 1):
        assert incremental_ids([text[:cut], text[cut:]]) == expected, cut
    assert incremental_ids(list(text)) == expected


def test_ids_are_released_a_word_behind():
    tokenizer = IncrementalTokenizer(TOKENIZER)
    assert tokenizer.feed("Hello") == TOKENIZER.encode("<|im_start|>assistant").ids  # "\n" and "Hello" wait
    assert tokenizer.feed(" wor") == TOKENIZER.encode("\nHello").ids                 # " wor" may go on
    assert tokenizer.feed("ld, and") == TOKENIZER.encode(" world,").ids
    assert tokenizer.feed("") == []
    assert tokenizer.finish() == TOKENIZER.encode(" and").ids


def test_blank_text_is_reported():
    tokenizer = IncrementalTokenizer(TOKENIZER)
    tokenizer.feed("\n\n")
    tokenizer.feed("  \t")
    assert tokenizer.is_blank
    tokenizer.feed(" a")
    assert not tokenizer.is_blank
