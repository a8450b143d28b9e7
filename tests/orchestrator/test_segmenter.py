"""The narration segmenter (orchestrator/segmenter.py): a long input cut into segments, each one talker request:
paragraphs, sentences and clauses in several scripts, the first segment one sentence, every segment within the
limits, offsets exact, nothing lost, and a cost linear in the input."""
import random
import re
import time
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_tts.orchestrator.segmenter import BOUNDARIES, Segment, segment_text


def texts(segments: list[Segment]) -> list[str]:
    return [s.text for s in segments]


def check(text: str, segments: list[Segment], max_chars: int, first_max_chars: int | None = None,
          fits=None) -> None:
    """What holds for every input: segments in order, stripped, exact offsets, nothing lost or added, within the
    limits, the last one's boundary "end" and only that one's."""
    position = 0
    for i, segment in enumerate(segments):
        assert segment.index == i
        assert segment.text and segment.text == text[segment.start:segment.end].strip()
        assert segment.start >= position and text[position:segment.start].strip() == ""
        limit = first_max_chars if i == 0 and first_max_chars is not None else max_chars
        assert len(segment.text) <= limit
        assert fits is None or fits(segment.text)
        assert segment.boundary in BOUNDARIES and (segment.boundary == "end") == (i == len(segments) - 1)
        position = segment.end
    assert text[position:].strip() == ""


@pytest.mark.parametrize("text", ["", " ", "\n\n \t\n", "\u3000\u00a0"])
def test_nothing_to_say_is_no_segment(text):
    assert segment_text(text) == []


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        segment_text("Hello.", max_chars=0)
    with pytest.raises(ValueError, match="at least 1"):
        segment_text("Hello.", first_max_chars=0)


def test_one_sentence_is_one_segment_that_ends_it_all():
    assert segment_text("  Hello there.  ") == [Segment(0, "Hello there.", 2, 14, "end")]


def test_a_segment_never_spans_two_paragraphs():
    text = "First one. Second one.\n\nThird one.\n \t \nFourth one. Fifth one."
    segments = segment_text(text, max_chars=1000)
    assert [(s.text, s.boundary) for s in segments] == [
        ("First one.", "sentence"), ("Second one.", "paragraph"), ("Third one.", "paragraph"),
        ("Fourth one. Fifth one.", "end")]
    check(text, segments, 1000)


def test_windows_line_breaks_are_line_breaks():
    text = "First one. Second one.\r\n\r\nThird one. Fourth one.\r\nStill the fourth paragraph."
    assert [(s.text, s.boundary) for s in segment_text(text)] == [
        ("First one.", "sentence"), ("Second one.", "paragraph"),
        ("Third one. Fourth one.\r\nStill the fourth paragraph.", "end")]


def test_wrapped_prose_reads_on_across_its_line_breaks():
    text = ("It was a bright cold day in April, and the clocks were striking\n"
            "thirteen. Winston Smith, his chin nuzzled into his breast in an effort\n"
            "Escaping the vile wind, slipped quickly through the glass doors of\n"
            "Victory Mansions, though not quickly enough to prevent a swirl of\n"
            "gritty dust from entering along with him.")
    assert texts(segment_text(text, max_chars=1000)) == [
        "It was a bright cold day in April, and the clocks were striking\nthirteen.",
        text[text.index("Winston"):]]


def test_headings_list_items_and_verse_lines_end_sentences():
    text = ("Chapter One\nThe Beginning\nIt was late. We left\n- bread and butter\n- two apples\n"
            "1) a knife\nRoses are red,\nViolets are blue\nand so are you.")

    def one_line(segment: str) -> bool:  # every line break is a cut: its boundary tells what it is
        return "\n" not in segment

    segments = segment_text(text, max_chars=1000, fits=one_line)
    assert [(s.text, s.boundary) for s in segments] == [
        ("Chapter One", "sentence"), ("The Beginning", "sentence"), ("It was late. We left", "sentence"),
        ("- bread and butter", "sentence"), ("- two apples", "sentence"), ("1) a knife", "sentence"),
        ("Roses are red,", "sentence"), ("Violets are blue", "clause"), ("and so are you.", "end")]
    check(text, segments, 1000, fits=one_line)
    assert segment_text(text)[0].text == "Chapter One"


def test_the_first_segment_is_the_first_sentence_alone():
    text = "Short. The rest packs together. Into one segment. Here."
    assert texts(segment_text(text)) == ["Short.", "The rest packs together. Into one segment. Here."]


def test_first_max_chars_cuts_the_first_sentence_further():
    text = "Once upon a time, in a land far away, there lived a king. He was old."
    segments = segment_text(text, max_chars=100, first_max_chars=20)
    assert [(s.text, s.boundary) for s in segments] == [
        ("Once upon a time,", "clause"), ("in a land far away, there lived a king. He was old.", "end")]
    check(text, segments, 100, 20)


def test_sentences_are_packed_within_max_chars():
    sentences = [f"Sentence number {i} is here." for i in range(12)]  # 27 or 28 characters each
    segments = segment_text(" ".join(sentences), max_chars=60)
    assert texts(segments) == [sentences[0]] + [f"{a} {b}" for a, b in zip(sentences[1::2], sentences[2::2])] + [
        sentences[11]]


def test_fits_is_respected_as_well():
    sentences = [f"One two three {i}." for i in range(9)]
    text = " ".join(sentences)

    def fits(segment: str) -> bool:
        return len(segment.split()) <= 8

    segments = segment_text(text, max_chars=1000, fits=fits)
    assert texts(segments) == [sentences[0], *(f"{a} {b}" for a, b in zip(sentences[1::2], sentences[2::2]))]
    check(text, segments, 1000, fits=fits)
    # a sentence that fits no call is cut like one over max_chars
    assert texts(segment_text("a b c d e, f g h i j k l m n, o.", fits=lambda s: len(s.split()) <= 4)) == [
        "a b c d", "e,", "f g h i", "j k l m", "n, o."]


CLAUSES = [
    ("english", "When the rain stopped, we walked out; the streets shone: everything — all of it — was new.", 40,
     ["When the rain stopped, we walked out;", "the streets shone: everything —", "all of it — was new."]),
    ("german", "Als der Regen aufhörte, gingen wir hinaus; die Straßen glänzten, alles war neu und still.", 45,
     ["Als der Regen aufhörte, gingen wir hinaus;", "die Straßen glänzten,", "alles war neu und still."]),
    ("french", "Quand la pluie cessa, nous sortîmes ; les rues brillaient, et tout était neuf.", 40,
     ["Quand la pluie cessa, nous sortîmes ;", "les rues brillaient, et tout était neuf."]),
    ("spanish", "Cuando paró la lluvia, salimos a la calle; las calles brillaban, todo era nuevo.", 45,
     ["Cuando paró la lluvia, salimos a la calle;", "las calles brillaban, todo era nuevo."]),
    ("russian", "Когда дождь кончился, мы вышли на улицу; улицы блестели, всё было новым.", 40,
     ["Когда дождь кончился, мы вышли на улицу;", "улицы блестели, всё было новым."]),
    ("chinese", "雨停了以后，我们走到街上；街道闪闪发光，一切都是新的，连空气都是甜的。", 12,
     ["雨停了以后，", "我们走到街上；", "街道闪闪发光，", "一切都是新的，", "连空气都是甜的。"]),
    ("japanese", "雨がやんだので、私たちは外に出た。", 10, ["雨がやんだので、", "私たちは外に出た。"]),
    ("korean", "비가 그치자, 우리는 밖으로 나갔고, 거리는 반짝였다.", 16,
     ["비가 그치자,", "우리는 밖으로 나갔고,", "거리는 반짝였다."]),
    ("arabic", "عندما توقف المطر، خرجنا إلى الشارع؛ كانت الشوارع تلمع.", 25,
     ["عندما توقف المطر،", "خرجنا إلى الشارع؛", "كانت الشوارع تلمع."]),
    ("hindi", "जब बारिश रुकी, हम बाहर गए; सड़कें चमक रही थीं।", 20,
     ["जब बारिश रुकी,", "हम बाहर गए;", "सड़कें चमक रही थीं।"]),
]


@pytest.mark.parametrize("text,max_chars,expected", [c[1:] for c in CLAUSES], ids=[c[0] for c in CLAUSES])
def test_a_long_sentence_is_cut_at_its_clauses(text, max_chars, expected):
    segments = segment_text(text, max_chars=max_chars)
    assert texts(segments) == expected
    assert [s.boundary for s in segments] == ["clause"] * (len(expected) - 1) + ["end"]
    check(text, segments, max_chars)


def test_sentences_in_several_scripts():
    sentences = ["Hallo.", "Wie geht's?", "Bonjour.", "Ça va\u00a0?", "¡Hola!", "¿Qué tal?", "Привет.", "Как дела?",
                 "你好。", "你好吗？", "こんにちは。", "元気？", "안녕하세요.", "잘 지내요?", "مرحبا.", "كيف حالك؟",
                 "नमस्ते।", "आप कैसे हैं?"]
    text = " ".join(sentences).replace("。 ", "。").replace("？ ", "？")

    def one_mark(segment: str) -> bool:  # so that each segment is one sentence
        return sum(char in ".?!。？।؟" for char in segment) <= 1

    segments = segment_text(text, fits=one_mark)
    assert texts(segments) == sentences
    check(text, segments, 300, fits=one_mark)


def test_a_clause_too_long_is_cut_at_whitespace_never_inside_a_word():
    text = "Supercalifragilistic expialidocious words keep coming without any pause at all until the end."
    segments = segment_text(text, max_chars=25)
    assert texts(segments) == ["Supercalifragilistic", "expialidocious words keep", "coming without any pause",
                               "at all until the end."]
    words = set(text.split())
    assert all(set(s.text.split()) <= words for s in segments)


def test_a_run_without_whitespace_is_cut_at_the_limit():
    text = "这是一个没有任何标点符号也没有空格的很长很长的句子它一直说下去"
    segments = segment_text(text, max_chars=10)
    assert texts(segments) == [text[:10], text[10:20], text[20:30], text[30:]]
    assert [s.boundary for s in segments] == ["clause", "clause", "clause", "end"]


def test_a_cut_at_the_limit_keeps_combining_marks_with_their_letter():
    text = "कि" * 30  # a consonant and its vowel sign, no whitespace
    segments = segment_text(text, max_chars=7)
    assert all(unicodedata.category(s.text[0])[0] != "M" for s in segments)
    assert "".join(texts(segments)) == text
    check(text, segments, 7)


def test_a_cut_at_the_limit_with_fits_takes_the_longest_prefix_that_fits():
    text = "あ" * 25
    segments = segment_text(text, max_chars=10, fits=lambda s: len(s.encode()) <= 21)  # 3 bytes a character
    assert texts(segments) == ["あ" * 7, "あ" * 7, "あ" * 7, "あ" * 4]


SENTENCE_POOL = [
    "The night was cold.", "Mr. Smith said nothing, e.g. about the war.", '"Stop!" she cried.',
    "It cost 3.50 dollars, or so.", "Wait... what happened next?", "J. R. R. Tolkien wrote it.",
    "Er kam z.B. später.", "¿Qué hora es?", "Il dit «\u00a0non\u00a0».", "Всё было новым.", "雨停了。",
    "私たちは外に出た。", "거리는 반짝였다.", "كانت الشوارع تلمع.", "सड़कें चमक रही थीं।",
    "A long sentence that goes on, with clauses; and more clauses: and an aside — like this one — before the end "
    "of it, which takes a while, because it has much to say about nothing in particular, and then some more.",
]


def generated(rng: random.Random, num_paragraphs: int) -> tuple[str, list[list[str]]]:
    """Paragraphs of sentences from the pool; a line break between two sentences reads as whitespace."""
    paragraphs = [[rng.choice(SENTENCE_POOL) for _ in range(rng.randint(1, 12))] for _ in range(num_paragraphs)]
    text = rng.choice(["\n\n", " \n \n"]).join(
        "".join(sentence + rng.choice([" ", "  ", "\n", " \n"]) for sentence in paragraph).rstrip()
        for paragraph in paragraphs)
    return text, paragraphs


@pytest.mark.parametrize("seed", range(6))
def test_properties_on_a_long_generated_text(seed):
    rng = random.Random(seed)
    text, paragraphs = generated(rng, 60)
    max_chars = rng.choice([40, 80, 150, 300])
    first_max_chars = rng.choice([None, 20, 60])
    budget = rng.choice([None, 12, 30])
    fits = None if budget is None else (lambda s: len(s.split()) <= budget)
    segments = segment_text(text, max_chars=max_chars, first_max_chars=first_max_chars, fits=fits)
    check(text, segments, max_chars, first_max_chars, fits)
    # no word is longer than any limit here: the words are the input's, in order
    assert " ".join(texts(segments)).split() == text.split()
    # the first segment is the first sentence, or its first part
    first = paragraphs[0][0]
    assert segments[0].text == first if segments[0].boundary != "clause" else first.startswith(segments[0].text)
    # a segment ends where a sentence does ("sentence", "paragraph", "end") or inside one ("clause")
    ends = set()
    position = 0
    for paragraph in paragraphs:
        for sentence in paragraph:
            position = text.index(sentence, position) + len(sentence)
            ends.add(position)
    for segment in segments:
        assert (segment.end in ends) == (segment.boundary != "clause")
    # a paragraph boundary is where the text has a blank line, and no segment holds one
    for segment, following in zip(segments, segments[1:]):
        blank_line = re.search(r"\n\s*\n", text[segment.end:following.start]) is not None
        assert blank_line == (segment.boundary == "paragraph")
        assert re.search(r"\n\s*\n", segment.text) is None


@settings(max_examples=300, deadline=None, database=None)
@given(st.text(st.sampled_from(list("aB .,;:!?…—–-\n\r\u00a0\u3000。，、」”»\"'「Mr1)।ि")), max_size=200),
       st.integers(1, 30), st.none() | st.integers(1, 30))
def test_any_text_holds_the_invariants(text, max_chars, first_max_chars):
    check(text, segment_text(text, max_chars=max_chars, first_max_chars=first_max_chars), max_chars, first_max_chars)


@pytest.mark.parametrize("shape", ["prose", "one sentence of clauses", "one clause of words", "no whitespace",
                                   "fits"])
def test_200000_characters_in_linear_time(shape):
    """A deadline, not a benchmark: linear work on 200,000 characters takes well under a second of CPU, quadratic
    work minutes. CPU time, so that a busy neighbour does not count."""
    rng = random.Random(0)
    text, fits = {
        "prose": (generated(rng, 1000)[0], None),
        "one sentence of clauses": ("a few words here, " * 11_200, None),
        "one clause of words": ("word " * 40_000, None),
        "no whitespace": ("字" * 200_000, None),
        "fits": (generated(rng, 1000)[0], lambda s: len(s.split()) <= 40),
    }[shape]
    text = text[:200_000]
    assert len(text) == 200_000
    started = time.process_time()
    segments = segment_text(text, fits=fits)
    cpu_seconds = time.process_time() - started
    check(text, segments, 300, fits=fits)
    assert cpu_seconds < 20
