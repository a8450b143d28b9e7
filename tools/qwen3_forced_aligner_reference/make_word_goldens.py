#!/usr/bin/env python3
"""Golden word lists and timestamp fix-ups from the official Qwen3-ForcedAligner processor, for
tests/models/test_aligner_words.py.

Run with the reference virtualenv's python (setup_reference_env.sh):

    ~/.cache/qwen3-forced-aligner-reference/venv/bin/python make_word_goldens.py OUT.json
    ~/.cache/qwen3-forced-aligner-reference/venv/bin/python make_word_goldens.py --compare 200000

The first form writes the fixture: `Qwen3ForceAlignProcessor.encode_timestamp(text, language)[0]` for every text
below in several languages, and `fix_timestamp(values)` for random series (seeded). The second writes nothing: it
imports omni_tts's words.py from this checkout (it needs nothing but the standard library and, for Japanese,
nagisa, both here) and compares it with the reference on every text and on that many random series,
printing what differs. Only the reference's public processor class is called; none of its code is copied.
"""
import argparse
import importlib
import json
import random
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np
from qwen_asr.inference.qwen3_forced_aligner import Qwen3ForceAlignProcessor

CHECKOUT = Path(__file__).resolve().parents[2]
LANGUAGES = ("English", "Japanese", "Korean")
SEED = 24

TEXTS = [
    # English: punctuation, numbers, contractions, hyphens, URLs, emoji
    "Hello, world! How are you today?",
    "Pi is 3.14, and 1,000 people paid $5 each (50% off) on 12/31/2024 at 9:30 a.m.",
    "I don't think we'll make it; it's Bob's car, isn't it? Rock 'n' roll, ' '' '.",
    "Don’t use curly quotes “like this” or ‘these’.",
    "A state-of-the-art, well-known re-entry — with an em dash – and an en dash.",
    "Visit https://example.com/path?q=1&x=2#top or mail john.doe@example.org, @handle #hashtag.",
    "I love pizza 🍕🍕 and 👍🏽 thumbs! ❤\ufe0f 👨\u200d👩\u200d👧",
    "x² + ½ = ⅔, chapter Ⅻ, H₂O, 10℃, ①②③",
    # Chinese, with Latin and digits
    "今天天气很好，我们去公园散步吧。",
    "我在2024年买了iPhone15Pro，花了8999.5元。GPT-4很强大！",
    "《三体》是刘慈欣写的 sci-fi 小说 — 非常好看",
    "𠀀𪜀㐀豈鿿一 rare and compatibility ideographs",
    # Japanese
    "東京都に住んでいます。今日はいい天気ですね！",
    "カタカナとひらがな、そして漢字。コーヒーを2杯ください。",
    "ｶﾀｶﾅ半角と・中黒、っゃゅょ。Pythonは3.14です。",
    "吾輩は猫である。名前はまだ無い。どこで生れたかとんと見当がつかぬ。",
    # Korean
    "안녕하세요, 저는 학생입니다. 오늘 날씨가 정말 좋네요!",
    "대한민국의 수도는 서울입니다. 가마속에 밥을 했습니다.",
    "AI 기술은 2025년에 크게 발전했습니다. 나는 밥을 먹었다 ㅋㅋㅋ ㅜㅠ",
    "힘들었지만 힘내서 힘차게 가만히 가맹점에서 삼촌과 힙합을 들었다.",
    # accented Latin, Cyrillic, Arabic, Devanagari, Thai (no spaces), Greek, Hebrew
    "Die Straße ist schön; übermäßig große Äpfel!",
    "L'été à Paris, c'est très agréable — n'est-ce pas\xa0?",
    "¿Dónde está el baño? ¡Mañana, señor!",
    "Привет, как дела? Всё хорошо.",
    "مرحبا بالعالم، كيف حالك؟ الس\u0651\u064eلام\u064f ع\u064eل\u064eي\u0652ك\u064fم\u0652 ١٢٣",
    "नमस\u094dत\u0947 द\u0941निया। आप क\u0948स\u0947 ह\u0948\u0902?",
    "สว\u0e31สด\u0e35คร\u0e31บย\u0e34นด\u0e35ท\u0e35\u0e48ได\u0e49ร\u0e39\u0e49จ\u0e31ก",
    "Καλημέρα κόσμε; ש\u05c1\u05b8לו\u05b9ם עולם",
    # mixed scripts
    "Hello世界こんにちは안녕 Привет123 mixed中文text",
    "OK，我们meeting在3点开始；会议室A-101。",
    # empty, punctuation only, whitespace of every kind
    "",
    "...!?;:—…。！？「」",
    "  many   spaces\n\nnew lines\ttabs\r\nand CRLF\x0bvertical\x0cfeed  ",
    "no\xa0break\u2009thin\u3000ideographic\u200bzero-width\u2028line\u2029para\u202fnarrow\u205fmath"
    "\u1680ogham\x85nel",
    # combining marks (NFD) and their NFC forms, full-width characters
    "Cafe\u0301 re\u0301sume\u0301 — Café résumé; n\u0303 ñ",
    "ＡＢＣ１２３，全角！Ｈｅｌｌｏ\u3000Ｗｏｒｌｄ",
    # longer passages
    "The quick brown fox jumps over the lazy dog. " * 6 + "It's 2:45 p.m.; the temperature is -3.5°C.",
    "从前有座山，山里有座庙，庙里有个老和尚在讲故事。" * 3,
]
# the reference lower-cases the language; any other name takes the whitespace path
SPELLINGS = [(TEXTS[12], "japanese"), (TEXTS[12], "JAPANESE"), (TEXTS[16], "korean"), (TEXTS[16], "KoReAn"),
             (TEXTS[8], "Chinese"), (TEXTS[8], "Auto"), (TEXTS[21], "French"), (TEXTS[16], "auto")]


def random_series(rng: random.Random, n: int) -> list[float]:
    """Predicted times in the shapes that make the fix-up work: ties, runs, decreasing stretches, spikes."""
    shape = rng.randrange(8)
    if shape == 0:  # a small range of classes: ties everywhere
        top = rng.choice((1, 2, 3, 5, 10))
        return [rng.randint(0, top) * 80.0 for _ in range(n)]
    if shape == 1:  # a noisy ramp
        rate, sigma = rng.uniform(0.2, 3.0), rng.uniform(0.3, 4.0)
        return [max(0, round(i * rate + rng.gauss(0, sigma))) * 80.0 for i in range(n)]
    if shape == 2:  # a ramp with reversed stretches
        series = sorted(rng.randint(0, n) * 80.0 for _ in range(n))
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(n)
            b = min(n, a + rng.randint(2, 12))
            series[a:b] = series[a:b][::-1]
        return series
    if shape == 3:  # runs of one value, in any order
        series = []
        while len(series) < n:
            series += [rng.randint(0, 12) * 80.0] * rng.randint(1, 5)
        return series[:n]
    if shape == 4:  # decreasing, with ties
        return sorted((rng.randint(0, max(1, n // 2)) * 80.0 for _ in range(n)), reverse=True)
    if shape == 5:  # monotonic but for spikes up and down, alone or in runs
        series = sorted(rng.randint(0, 3 * n) * 80.0 for _ in range(n))
        for _ in range(rng.randint(1, 1 + n // 8)):
            a = rng.randrange(n)
            spike = rng.choice((0.0, 80.0 * 4 * n, series[rng.randrange(n)]))
            for k in range(a, min(n, a + rng.randint(1, 5))):
                series[k] = spike
        return series
    if shape == 6:  # times off the 80 ms grid: the interpolation's truncation shows
        return [round(rng.uniform(0, 1000), rng.choice((0, 1, 3))) for _ in range(n)]
    # word pairs (start, end) over an audio, some words mispredicted
    series, t = [], 0
    for _ in range((n + 1) // 2):
        t += rng.randint(0, 4)
        end = t + rng.randint(0, 6)
        pair = [t * 80.0, end * 80.0]
        if rng.random() < 0.15:
            pair = [rng.randint(0, 4 * n) * 80.0, rng.randint(0, 4 * n) * 80.0]
        series += pair
        t = end
    return series[:n]


def series_lengths(rng: random.Random, count: int) -> list[int]:
    return [rng.randint(1, 40) if k % 10 else rng.randint(41, 400) for k in range(count)]


def compact(value: float) -> float | int:
    """JSON numbers as short as they are exact: the test reads each back as a float."""
    return int(value) if value == int(value) else value


def make_goldens(processor: Qwen3ForceAlignProcessor) -> dict:
    cases = [(text, language) for text in TEXTS for language in LANGUAGES] + SPELLINGS
    words = [{"text": text, "language": language, "words": processor.encode_timestamp(text, language)[0]}
             for text, language in cases]
    rng = random.Random(SEED)
    fixups = []
    for n in series_lengths(rng, 300) + [4000]:
        values = random_series(rng, n)
        fixups.append({"values": [compact(v) for v in values],
                       "fixed": processor.fix_timestamp(np.array(values, dtype=np.float64))})
    return {"reference": {name: metadata.version(name) for name in ("qwen-asr", "nagisa", "soynlp")},
            "python": sys.version.split()[0], "words": words, "fix_timestamp": fixups}


def load_ours():
    sys.path.insert(0, str(CHECKOUT))
    return importlib.import_module("omni_tts.models.qwen3_forced_aligner.words")


def compare(processor: Qwen3ForceAlignProcessor, count: int) -> int:
    ours = load_ours()
    assert ours.japanese_segmenter_available()
    differences = 0
    for text in TEXTS:
        for language in LANGUAGES + ("Chinese", "auto"):
            expected = processor.encode_timestamp(text, language)[0]
            got = ours.split_words(text, language)
            if got != expected:
                differences += 1
                print(f"words differ: {language} {text!r}\n  reference {expected}\n  ours      {got}")
    rng = random.Random()
    seed = rng.randrange(2 ** 32)
    rng.seed(seed)
    for k, n in enumerate(series_lengths(rng, count)):
        values = random_series(rng, n)
        expected = processor.fix_timestamp(np.array(values, dtype=np.float64))
        if ours.fix_timestamp(values) != expected:
            differences += 1
            print(f"fix_timestamp differs (seed {seed}, case {k}): {values}")
    long = random_series(rng, 4000)
    start = time.perf_counter()
    ours.fix_timestamp(long)
    print(f"ours on n=4000: {1e3 * (time.perf_counter() - start):.1f} ms", end="; ")
    start = time.perf_counter()
    processor.fix_timestamp(np.array(long))
    print(f"the reference: {1e3 * (time.perf_counter() - start):.1f} ms")
    print(f"{len(TEXTS)} texts x {len(LANGUAGES) + 2} languages, {count} random series (seed {seed}): "
          f"{differences} differences")
    return differences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", type=Path, help="the fixture to write (JSON)")
    parser.add_argument("--compare", type=int, metavar="N", help="compare omni_tts with the reference on N series")
    args = parser.parse_args()
    processor = Qwen3ForceAlignProcessor()
    if args.compare:
        sys.exit(1 if compare(processor, args.compare) else 0)
    if args.out is None:
        parser.error("give OUT or --compare N")
    args.out.write_text(json.dumps(make_goldens(processor), ensure_ascii=False, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
