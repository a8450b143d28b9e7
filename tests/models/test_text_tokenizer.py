"""The Qwen2 pre-tokenizer regex (not Mistral's) and the shipped vocab/merges."""
from conftest import FIXTURES
from omni_tts.models.qwen3_tts.text_tokenizer import load_text_tokenizer, write_text_tokenizer_files


def test_qwen2_regex_keeps_mixed_case_words_whole():
    tok = load_text_tokenizer(str(FIXTURES / "tiny-base"))
    assert tok.encode("an iPhone").tokens == ["an", "ĠiPhone"]  # Mistral's regex would split i / Phone
    assert tok.encode("Hello world").ids == [9707, 1879]
    assert tok.encode("12345").tokens == ["1", "2", "3", "4", "5"]  # single-digit numbers
    assert tok.encode("<|im_start|>assistant\n").ids == [151644, 77091, 198]
    assert tok.decode(tok.encode("今天天气很好 iPhone 15 Pro!").ids) == "今天天气很好 iPhone 15 Pro!"


def test_shipped_tokenizer_files_rebuild_the_same_tokenizer(tmp_path):
    write_text_tokenizer_files(str(tmp_path))
    ours, fixture = load_text_tokenizer(str(tmp_path)), load_text_tokenizer(str(FIXTURES / "tiny-base"))
    text = "Mixed 中文 text, NFC: e\u0301 café — tabs\tand\nnewlines 2026."
    assert ours.encode(text).ids == fixture.encode(text).ids
    assert ours.get_vocab_size() == fixture.get_vocab_size() == 151646
