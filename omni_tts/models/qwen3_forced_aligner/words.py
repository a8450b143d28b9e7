"""The forced aligner's words and the fix-up of its timestamps, equal to the official processor's
(`Qwen3ForceAlignProcessor` in qwen-asr 0.0.6): `split_words` cuts a text into the words the model times, one start
and one end each; `fix_timestamp` turns the predicted times into a non-decreasing series.

Words per language: Japanese by the `nagisa` segmenter (the optional extra `ja`; without it, each kana or CJK
character a word, other letters and digits in runs cut by anything else), Korean by soynlp's `LTokenizer` over the
reference's dictionary (`assets/korean_dict_jieba.dict.gz`, its file gzipped), every other language (and none) on
whitespace, each CJK character a word by itself. A word keeps only letters, digits and apostrophes; a piece left
empty is no word.
"""
from __future__ import annotations

import bisect
import functools
import gzip
import logging
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from importlib import resources
from types import ModuleType

logger = logging.getLogger(__name__)

KOREAN_DICTIONARY = "korean_dict_jieba.dict.gz"

_CJK_RANGES = (
    (0x4E00, 0x9FFF),  # CJK Unified Ideographs
    (0x3400, 0x4DBF),  # Extension A
    (0x20000, 0x2A6DF),  # Extension B
    (0x2A700, 0x2B73F),  # Extension C
    (0x2B740, 0x2B81F),  # Extension D
    (0x2B820, 0x2CEAF),  # Extension E
    (0xF900, 0xFAFF),  # Compatibility Ideographs
)
_KANA_RANGES = (
    (0x3040, 0x309F),  # Hiragana
    (0x30A0, 0x30FF),  # Katakana
    (0x31F0, 0x31FF),  # Katakana Phonetic Extensions
    (0xFF66, 0xFF9F),  # half-width Katakana
)


def split_words(text: str, language: str | None) -> list[str]:
    """The words the aligner times in `text`, in order. `language` as the API carries it ("English", "Japanese",
    "Auto", None, any case): "japanese" and "korean" take their segmenters, anything else the whitespace path."""
    kind = (language or "").lower()
    if kind == "japanese":
        nagisa = _nagisa()
        if nagisa is None:  # as the reference's (unused) tokenize_chinese_mixed cuts, kana counted in
            return _split_runs(text, lambda ch: _is_cjk(ch) or _in_ranges(ch, _KANA_RANGES), lambda ch: True)
        return _kept_words(nagisa.tagging(text).words)
    if kind == "korean":
        return _kept_words(piece for token in text.split() for piece in _korean_left_right(token))
    return _split_runs(text, _is_cjk, str.isspace)  # str.split()'s whitespace


def japanese_segmenter_available() -> bool:
    """Whether Japanese is cut by `nagisa` as the reference does, rather than one word per kana or CJK character.
    Imports it (about a second, its model loads): call it once, at start-up."""
    return _nagisa() is not None


def fix_timestamp(values: Sequence[float]) -> list[int]:
    """The predicted times (a word's start then its end, for every word) made non-decreasing, as the reference does:
    the values off one longest non-decreasing subsequence (the reference's choice among equally long ones) are
    replaced, a run of one or two by its nearer kept neighbour (the left one on a tie), a longer run by a linear
    interpolation between its kept neighbours (a run at either end by its one neighbour); then truncated to int.
    O(n log n): a long narration has thousands of values."""
    values = [float(v) for v in values]
    n = len(values)
    kept = _longest_non_decreasing(values)
    fixed = list(values)
    i = 0
    while i < n:
        if kept[i]:
            i += 1
            continue
        j = i
        while j < n and not kept[j]:
            j += 1
        # the run [i, j) is maximal, so its neighbours are kept values (at least one exists: kept is never empty)
        left = values[i - 1] if i > 0 else None
        right = values[j] if j < n else None
        count = j - i
        for k in range(i, j):
            if left is None:
                fixed[k] = right
            elif right is None:
                fixed[k] = left
            elif count <= 2:
                fixed[k] = left if k - (i - 1) <= j - k else right
            else:
                fixed[k] = left + (right - left) / (count + 1) * (k - i + 1)
        i = j
    return [int(v) for v in fixed]


def _longest_non_decreasing(values: list[float]) -> list[bool]:
    """Marks one longest non-decreasing subsequence: the one the reference's O(n²) programme keeps. There each value
    extends the longest chain ending at an earlier value <= it, the earliest such chain end on a tie, and the walk
    back starts at the earliest end of a longest chain. Here a Fenwick tree over the sorted distinct values holds
    the prefix maximum of (length, -index), packed into one int, so both ties break the same way."""
    n = len(values)
    distinct = sorted(set(values))
    tree = [0] * (len(distinct) + 1)  # 0 = no chain; a chain end is length * n + (n - 1 - index)
    parent = [-1] * n
    best = 0
    for i, value in enumerate(values):
        rank = bisect.bisect_right(distinct, value)  # the tree's positions 1..rank hold the values <= value
        found, p = 0, rank
        while p:
            found = max(found, tree[p])
            p &= p - 1
        if found:
            parent[i] = n - 1 - found % n
        end = (found // n + 1) * n + (n - 1 - i)
        best = max(best, end)
        p = rank
        while p < len(tree):
            tree[p] = max(tree[p], end)
            p += p & -p
    kept = [False] * n
    i = n - 1 - best % n if n else -1
    while i != -1:
        kept[i] = True
        i = parent[i]
    return kept


def _split_runs(text: str, is_own_word: Callable[[str], bool], is_cut: Callable[[str], bool]) -> list[str]:
    """Runs of kept characters; a dropped character `is_cut` accepts ends a run, a kept one `is_own_word` accepts is
    a word by itself."""
    words: list[str] = []
    run: list[str] = []
    for ch in text:
        kept = _is_kept(ch)
        if kept and not is_own_word(ch):
            run.append(ch)
        elif kept or is_cut(ch):
            if run:
                words.append("".join(run))
                run = []
            if kept:
                words.append(ch)
    if run:
        words.append("".join(run))
    return words


def _korean_left_right(token: str) -> tuple[str, ...]:
    """soynlp's `LTokenizer` (default score 0, tolerance 0) on one whitespace token over the reference's dictionary
    (every entry scores 1): past two characters, the longest dictionary prefix of at least two characters and the
    rest; no such prefix, the whole token."""
    if len(token) <= 2:
        return (token,)
    dictionary, longest = _korean_dictionary()
    for end in range(min(len(token), longest), 1, -1):
        if token[:end] in dictionary:
            return token[:end], token[end:]
    return (token,)


def _kept_words(pieces: Iterable[str]) -> list[str]:
    return [word for piece in pieces if (word := "".join(ch for ch in piece if _is_kept(ch)))]


def _is_kept(ch: str) -> bool:
    return ch == "'" or unicodedata.category(ch)[0] in "LN"


def _is_cjk(ch: str) -> bool:
    return _in_ranges(ch, _CJK_RANGES)


def _in_ranges(ch: str, ranges: tuple[tuple[int, int], ...]) -> bool:
    code = ord(ch)
    return any(low <= code <= high for low, high in ranges)


@functools.cache
def _korean_dictionary() -> tuple[frozenset[str], int]:
    """The dictionary's words (a line's first field) and the longest one's length."""
    with (resources.files(__package__) / "assets" / KOREAN_DICTIONARY).open("rb") as raw:
        with gzip.open(raw, "rt", encoding="utf-8") as lines:
            words = frozenset(line.split()[0] for line in lines if line.strip())
    return words, max(map(len, words))


@functools.cache
def _nagisa() -> ModuleType | None:
    try:
        import nagisa
    except ImportError:
        logger.warning("Japanese words are cut one per kana or CJK character: nagisa, the reference's segmenter, is "
                       "not installed (pip install 'omni_tts[ja]')")
        return None
    # loading DyNet turns on flush-to-zero / denormals-are-zero for the importing thread: every float comparison
    # with a denormal after it changes (msgspec's `gt=0.0` bound lets 0.0 through), so the mode is put back
    import torch
    torch.set_flush_denormal(False)
    return nagisa
