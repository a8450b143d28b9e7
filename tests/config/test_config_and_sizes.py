"""Config parsing (typed, strict on required keys, tolerant of unknown ones) and real-size parameter counts."""
import copy
import json

import pytest
import torch

from conftest import FIXTURES
from omni_tts.models.qwen3_tts.checkpoint_config import ConfigError, Qwen3TTSConfig, SpeechTokenizerConfig
from omni_tts.models.qwen3_tts.random_model import speech_tokenizer_config_dict, tts_config_dict


def _fixture_config(name="config.json"):
    return json.loads((FIXTURES / "tiny-custom-voice" / name).read_text())


def test_fixture_configs_parse():
    cfg = Qwen3TTSConfig.load(str(FIXTURES / "tiny-base"))
    assert cfg.tts_model_type == "base" and cfg.talker.hidden_size == 64
    assert cfg.talker.code_predictor.hidden_size == 32 and cfg.speaker_encoder.enc_dim == 64
    cv = Qwen3TTSConfig.load(str(FIXTURES / "tiny-custom-voice"))
    assert cv.talker.spk_id["ryan"] == 3061 and cv.talker.spk_is_dialect["dylan"] == "beijing_dialect"
    st = SpeechTokenizerConfig.load(str(FIXTURES / "tiny-base"))
    assert st.decoder.samples_per_frame == 1920 and st.decoder.sliding_window == 8


@pytest.mark.parametrize("path,where", [
    (("talker_config", "hidden_size"), "talker_config.hidden_size"),
    (("talker_config", "code_predictor_config", "num_hidden_layers"), "talker_config.code_predictor_config.num_hidden_layers"),
    (("tts_pad_token_id",), "tts_pad_token_id"),
])
def test_missing_required_key_is_named(path, where):
    data = _fixture_config()
    node = data
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    with pytest.raises(ConfigError, match=f"myckpt/config.json: missing required key '{where}'"):
        Qwen3TTSConfig.from_dict(data, "myckpt/config.json")


def test_wrong_type_and_unknown_keys():
    data = _fixture_config()
    data["some_future_key"] = {"x": 1}
    data["talker_config"]["another_unknown"] = 3
    Qwen3TTSConfig.from_dict(data)  # unknown keys are tolerated
    bad = copy.deepcopy(data)
    bad["talker_config"]["num_hidden_layers"] = "two"
    with pytest.raises(ConfigError, match="talker_config.num_hidden_layers' must be an integer"):
        Qwen3TTSConfig.from_dict(bad)
    bad = copy.deepcopy(data)
    bad["tts_model_type"] = "music"
    with pytest.raises(ConfigError, match="tts_model_type"):
        Qwen3TTSConfig.from_dict(bad)
    st = json.loads((FIXTURES / "tiny-custom-voice" / "speech_tokenizer" / "config.json").read_text())
    del st["decoder_config"]["sliding_window"]
    with pytest.raises(ConfigError, match="decoder_config.sliding_window"):
        SpeechTokenizerConfig.from_dict(st, "x/speech_tokenizer/config.json")


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json: file not found"):
        Qwen3TTSConfig.load(str(tmp_path))


@pytest.mark.parametrize("preset,base_total,other_total", [("0.6b", 914.6, 905.8), ("1.7b", 1928.7, 1916.7)])
def test_released_sizes_on_meta_device(preset, base_total, other_total):
    from omni_tts.models.qwen3_tts.model import Qwen3TTSWeights, SpeechTokenizerWeights

    def millions(module):
        return sum(p.numel() for p in module.parameters()) / 1e6

    with torch.device("meta"):
        base = Qwen3TTSWeights(Qwen3TTSConfig.from_dict(tts_config_dict("base", preset)))
        custom = Qwen3TTSWeights(Qwen3TTSConfig.from_dict(tts_config_dict("custom_voice", preset)))
        speech = SpeechTokenizerWeights(SpeechTokenizerConfig.from_dict(speech_tokenizer_config_dict(preset)), True)
    assert round(millions(base), 1) == base_total
    assert round(millions(custom), 1) == other_total
    assert round(millions(speech.decoder), 1) == 114.3
