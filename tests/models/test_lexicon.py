"""Pronunciation alias rules (models/qwen3_tts/lexicon.py): the first rule that matches at a position wins, case and
word boundaries as each rule says, and text fed in pieces, cut anywhere, is replaced exactly as the whole text."""
import pickle
import random

from omni_tts.models.qwen3_tts.lexicon import AliasRule, Lexicon

LEXICON = Lexicon((AliasRule("TTS", "text to speech"), AliasRule("New York", "the big apple", case_sensitive=False),
                   AliasRule("ab", "X", word_boundaries=False), AliasRule("abc", "Y", word_boundaries=False),
                   AliasRule("New", "Old")))
TEXTS = ["I love TTS and new york, TTSx, NEW YORKer. abcab New", "TTS", "New York New", "xabcabcab TTS TTS", "New",
         "tts TTS_ TTS."]


def test_the_first_matching_rule_wins_with_its_case_and_boundaries():
    assert LEXICON.apply(TEXTS[0]) == ("I love text to speech and the big apple, TTSx, NEW YORKer. XcX Old")
    assert LEXICON.apply("tts TTS_ TTS.") == "tts TTS_ text to speech."   # case-sensitive; `_` is a word character
    assert Lexicon.combine([None, Lexicon((AliasRule("a", "b"),)), None]).rules == (AliasRule("a", "b"),)
    assert Lexicon.combine([None]) is None


def test_text_in_pieces_is_replaced_as_the_whole_text():
    rng = random.Random(0)
    for text in TEXTS:
        whole = LEXICON.apply(text)
        for _ in range(200):
            cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(6, len(text)))))
            stream = LEXICON.stream()
            pieces = [stream.feed(text[a:b]) for a, b in zip([0, *cuts], [*cuts, len(text)])]
            assert "".join(pieces) + stream.finish() == whole, (text, cuts)


def test_a_held_back_tail_is_released_as_soon_as_it_is_decided():
    stream = LEXICON.stream()
    assert stream.feed("I love T") == "I love "          # "T" could still begin "TTS"
    assert stream.feed("TS and more Ne") == "text to speech and more "
    assert stream.finish() == "Ne"
    assert len(stream.pending) == 0


def test_a_lexicon_travels_pickled():   # serve-ray sends it with the request to a replica
    assert pickle.loads(pickle.dumps(LEXICON)).apply("TTS") == "text to speech"
