"""Where a sentence or a clause ends (orchestrator/text_splitter.py), the rule the WebSocket's split_granularity and
the narration segmenter share: prose in several scripts, and text that arrives in pieces cut as the whole would be."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_tts.orchestrator.text_splitter import CLOSERS, TextSplitter


def units(text: str, granularity: str = "sentence") -> list[str]:
    splitter = TextSplitter(granularity)
    return [*splitter.feed(text), *splitter.flush()]


SENTENCES = [
    ("plain", "One sentence here. A second one! And a third?", ["One sentence here.", "A second one!",
                                                                "And a third?"]),
    ("decimals and urls", "Pi is 3.14 today. See example.com/a.b now.", ["Pi is 3.14 today.",
                                                                          "See example.com/a.b now."]),
    ("closing quote", 'He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
    ("closing bracket", "It ended (at last.) Then it began.", ["It ended (at last.)", "Then it began."]),
    ("quote before a lowercase word", '"Really?" he asked. "Yes!" She nodded.',
     ['"Really?" he asked.', '"Yes!"', "She nodded."]),
    ("titles", "Mr. and Mrs. Smith met Dr. Jones and Prof. Lee at St. Paul's. They talked.",
     ["Mr. and Mrs. Smith met Dr. Jones and Prof. Lee at St. Paul's.", "They talked."]),
    ("latin", "Fruit, e.g. apples, i.e. food, etc. vs. meat. Done.",
     ["Fruit, e.g. apples, i.e. food, etc. vs. meat.", "Done."]),
    ("suffixes", "Martin Luther King Jr. spoke and Sam Sr. listened. End.",
     ["Martin Luther King Jr. spoke and Sam Sr. listened.", "End."]),
    ("initials", "J. R. R. Tolkien wrote it in the U.S. Army days. Then", ["J. R. R. Tolkien wrote it in the U.S. "
                                                                          "Army days.", "Then"]),
    ("the pronoun I", "Neither did I. Then we left.", ["Neither did I.", "Then we left."]),
    ("No. and Fig. before a number", "See No. 5 and Fig. 3. No. I will not.",
     ["See No. 5 and Fig. 3.", "No.", "I will not."]),
    ("a list item's number", "1. Buy milk. 2. Buy eggs.", ["1. Buy milk.", "2. Buy eggs."]),
    ("ellipsis", "Wait... what was that? Wait... Then silence. Hm… so.",
     ["Wait... what was that?", "Wait...", "Then silence.", "Hm… so."]),
    ("German quotes", "Er rief „Halt.“ Dann ging er. Sie kam z.B. später.",
     ["Er rief „Halt.“", "Dann ging er.", "Sie kam z.B. später."]),
    ("French guillemets", "Il dit «\u00a0Arrête.\u00a0» Puis il partit. Quoi\u00a0? Rien\u202f!",
     ["Il dit «\u00a0Arrête.\u00a0»", "Puis il partit.", "Quoi\u00a0?", "Rien\u202f!"]),
    ("Spanish", "¿Qué hora es? ¡Son las 3.30! La Sra. García llegó.",
     ["¿Qué hora es?", "¡Son las 3.30!", "La Sra. García llegó."]),
    ("Russian", "— Привет, — сказал он. — Да. А. С. Пушкин пришёл.",
     ["— Привет, — сказал он.", "— Да.", "А. С. Пушкин пришёл."]),
    ("Chinese", "你好。“停。”他说。好吧……然后呢？", ["你好。", "“停。”", "他说。", "好吧……", "然后呢？"]),
    ("Japanese", "こんにちは。「元気？」と聞いた。はい！", ["こんにちは。", "「元気？」", "と聞いた。", "はい！"]),
    ("Korean", "안녕하세요. 잘 지내요? 네!", ["안녕하세요.", "잘 지내요?", "네!"]),
    ("Hindi", "नमस्ते। आप कैसे हैं? ठीक॥ हाँ", ["नमस्ते।", "आप कैसे हैं?", "ठीक॥", "हाँ"]),
    ("Arabic", "مرحبا؟ كيف حالك. بخير", ["مرحبا؟", "كيف حالك.", "بخير"]),
    ("marks with no word before them end nothing", "... — Hello. Bye", ["... — Hello.", "Bye"]),
]


@pytest.mark.parametrize("text,expected", [c[1:] for c in SENTENCES], ids=[c[0] for c in SENTENCES])
def test_sentences(text, expected):
    assert units(text) == expected


CLAUSES = [
    ("english", "It costs 3,000 dollars, he said; fine: the time is 10:30 now.",
     ["It costs 3,000 dollars,", "he said;", "fine:", "the time is 10:30 now."]),
    ("dashes", "It was over—or so she thought – in 1990–2000 – done.",
     ["It was over—", "or so she thought –", "in 1990–2000 –", "done."]),
    ("dialogue dash", "— Привет, — сказал он.", ["— Привет,", "— сказал он."]),
    ("chinese", "苹果、香蕉，还有橘子；都好：是的。", ["苹果、", "香蕉，", "还有橘子；", "都好：", "是的。"]),
    ("arabic", "نعم، لا؛ ربما.", ["نعم،", "لا؛", "ربما."]),
]


@pytest.mark.parametrize("text,expected", [c[1:] for c in CLAUSES], ids=[c[0] for c in CLAUSES])
def test_clauses(text, expected):
    assert units(text, "clause") == expected


def test_none_keeps_the_whole_utterance():
    assert units("One. Two, three! 四。", "none") == ["One. Two, three! 四。"]


def test_a_unit_waits_for_what_decides_it():
    splitter = TextSplitter("sentence")
    assert splitter.feed("Hello.") == []  # a space must follow
    assert splitter.feed(" ") == ["Hello."]
    assert splitter.feed('He said "Stop." ') == []  # a lowercase word would go on
    assert splitter.feed("Wait... ") == ['He said "Stop."']  # and so would it here
    assert splitter.feed("what? No. ") == ["Wait... what?"]  # "No." before a number is an abbreviation
    assert splitter.feed("Then") == ["No."]
    assert splitter.feed("。") == ["Then。"]  # at once
    assert splitter.flush() == []


PIECES = st.sampled_from([
    "Mr.", "Dr.", "e.g.", "No.", "5", "J.", "I.", "the", "What", "said", "3.14", "...", "…", "?", "!", ".", ",", ";",
    ":", "—", "–", '"', "»", "«", "“", "„", ")", "(", "。", "，", "、", "”", "“", "「", "」", "?!", "a", "Then", "।",
    "؟", "，", "1.", "z.B.", "\u00a0", "\n", " ", " ", " ", "  "])


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(PIECES, max_size=40), st.data(), st.sampled_from(["sentence", "clause"]))
def test_text_in_pieces_is_cut_as_the_whole_would_be(pieces, data, granularity):
    text = "".join(pieces)
    # the marks of other scripts end a unit at once: a piece that ends with one (and closers) ends its unit
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)).filter(
        lambda cut: not text[:cut].rstrip("".join(CLOSERS)).endswith(tuple("。，、？！।॥؟—–"))), max_size=6)))
    splitter = TextSplitter(granularity)
    streamed = []
    for start, end in zip([0, *cuts], [*cuts, len(text)]):
        streamed += splitter.feed(text[start:end])
    streamed += splitter.flush()
    assert streamed == units(text, granularity)
    assert all(unit and unit == unit.strip() for unit in streamed)
    assert "".join("".join(streamed).split()) == "".join(text.split())  # nothing lost, nothing added
