"""The forced aligner's word splitting and timestamp fix-up equal the official processor's (qwen-asr 0.0.6) on every
golden of tests/fixtures/qwen3_forced_aligner/words/goldens.json (tools/qwen3_forced_aligner_reference/
make_word_goldens.py): word lists of many texts in several languages, and the fix-up of random series full of ties,
runs and decreasing stretches, the reference's choice among equally long subsequences included."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from omni_tts.models.qwen3_forced_aligner.words import fix_timestamp, japanese_segmenter_available, split_words

GOLDENS = json.loads((Path(__file__).parents[1] / "fixtures" / "qwen3_forced_aligner" / "words" /
                      "goldens.json").read_text())
WORDS = GOLDENS["words"]


def mismatches(cases: list[dict], language=lambda case: case["language"]) -> list[tuple]:
    return [(case["text"], case["language"], got, case["words"]) for case in cases
            if (got := split_words(case["text"], language(case))) != case["words"]]


def test_goldens_cover_every_path():
    languages = {case["language"].lower() for case in WORDS}
    assert {"english", "chinese", "auto", "japanese", "korean"} <= languages
    assert any(case["text"] == "" for case in WORDS) and len(WORDS) > 100
    assert max(len(case["values"]) for case in GOLDENS["fix_timestamp"]) == 4000


def test_words_equal_the_reference_outside_japanese():
    cases = [case for case in WORDS if case["language"].lower() != "japanese"]
    assert mismatches(cases) == []


def test_no_language_takes_the_whitespace_path_as_any_other_name_does():
    english = [case for case in WORDS if case["language"] == "English"]
    assert mismatches(english, language=lambda case: None) == []
    assert mismatches(english, language=lambda case: "Auto") == []


def test_japanese_words_equal_the_reference_with_nagisa():
    pytest.importorskip("nagisa")
    assert japanese_segmenter_available()
    assert mismatches([case for case in WORDS if case["language"].lower() == "japanese"]) == []


def test_japanese_without_nagisa_is_one_word_per_kana_or_cjk_character_and_runs_of_others():
    # an interpreter where `import nagisa` fails, as where the `ja` extra is not installed
    code = """if True:
        import json, sys
        sys.modules["nagisa"] = None
        from omni_tts.models.qwen3_forced_aligner.words import japanese_segmenter_available, split_words
        texts = json.loads(sys.stdin.read())
        print(json.dumps([japanese_segmenter_available(), [split_words(t, "Japanese") for t in texts]]))"""
    texts = ["東京都に住んでいます。", "コーヒーを2杯ください", "ｶﾀｶﾅ・Python 3.14、don't!", "", "。！"]
    done = subprocess.run([sys.executable, "-c", code], input=json.dumps(texts), capture_output=True, text=True,
                          check=True)
    available, words = json.loads(done.stdout)
    assert available is False
    assert words == [["東", "京", "都", "に", "住", "ん", "で", "い", "ま", "す"],
                     ["コ", "ー", "ヒ", "ー", "を", "2", "杯", "く", "だ", "さ", "い"],
                     ["ｶ", "ﾀ", "ｶ", "ﾅ", "Python", "3", "14", "don't"], [], []]


def test_fix_timestamp_equals_the_reference():
    cases = GOLDENS["fix_timestamp"]
    assert [fix_timestamp(case["values"]) for case in cases] == [case["fixed"] for case in cases]


@pytest.mark.parametrize("values, fixed", [
    # a lone outlier takes its nearer kept neighbour, the left one on a tie
    ([80, 0, 160, 2000, 240, 320], [80, 80, 160, 160, 240, 320]),
    # three or more in a row are interpolated between their kept neighbours
    ([0, 900, 900, 900, 400, 480, 560, 640], [0, 100, 200, 300, 400, 480, 560, 640]),
    # two longest subsequences: the reference keeps the one that ends first
    ([0, 900, 900, 900, 400, 480, 560], [0, 900, 900, 900, 900, 900, 900]),
    # a run at either end takes its one neighbour; times off the grid are truncated
    ([500, 100, 200, 300, 400, 0, 50, 60], [100, 100, 200, 300, 400, 400, 400, 400]),
    ([0.0, 9.0, 9.0, 9.0, 1.0, 2.0, 3.0, 4.0], [0, 0, 0, 0, 1, 2, 3, 4]),
    ([], []),  # no words (the reference raises on an empty series)
])
def test_fix_timestamp_examples(values, fixed):
    assert fix_timestamp(values) == fixed


def test_is_torch_free():
    code = "import sys, omni_tts.models.qwen3_forced_aligner.words; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_loading_the_japanese_segmenter_leaves_float_comparisons_alone():
    """DyNet's import sets denormals-are-zero, which lets msgspec's `gt=0.0` bound pass 0.0 (top_p=0 accepted)."""
    pytest.importorskip("nagisa")
    script = ("import msgspec\nfrom typing import Annotated\n"
              "from omni_tts.models.qwen3_forced_aligner.words import split_words\n"
              "split_words('今日は良い天気です。', 'Japanese')\n"
              "try:\n    msgspec.convert(0.0, Annotated[float, msgspec.Meta(gt=0.0)])\n    print('accepted')\n"
              "except msgspec.ValidationError:\n    print('refused')\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "refused"
