"""Checkpoint resolution and strict loading: sharded files, dtypes, errors, repo ids offline."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FIXTURES, case_arrays, case_requests, GOLDEN_CASES
from omni_tts.engine.offline import synthesize
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.weights import WeightsError, resolve_model_dir


def _copy_checkpoint(tmp_path, variant="tiny-custom-voice"):
    dst = tmp_path / variant
    shutil.copytree(FIXTURES / variant, dst)
    return dst


def test_sharded_checkpoint_gives_identical_output(tmp_path):
    ckpt = _copy_checkpoint(tmp_path)
    tensors = load_file(str(ckpt / "model.safetensors"))
    os.remove(ckpt / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(ckpt / shard))
        weight_map.update({k: shard for k in keys})
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    case = next(c for c in GOLDEN_CASES if c["name"] == "cv_en_streaming_layout")
    result = synthesize(Qwen3TTS.from_pretrained(str(ckpt)), case_requests(case))[0]
    np.testing.assert_array_equal(result.codes, case_arrays(case)["codes_0"])
    os.remove(ckpt / "model-00002-of-00002.safetensors")
    with pytest.raises(WeightsError, match="shard files missing: model-00002-of-00002.safetensors"):
        Qwen3TTS.from_pretrained(str(ckpt))


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    ckpt = _copy_checkpoint(tmp_path)
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["talker.codec_head.weight"]
    tensors["talker.extra_head.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(WeightsError, match=r"missing tensors: talker.codec_head.weight; unexpected tensors: "
                                           r"talker.extra_head.weight"):
        Qwen3TTS.from_pretrained(str(ckpt))


def test_shape_mismatch_and_missing_files(tmp_path):
    ckpt = _copy_checkpoint(tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["talker_config"]["intermediate_size"] = 96
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match=r"talker.model.layers.0.mlp.\w+_proj.weight has shape"):
        Qwen3TTS.from_pretrained(str(ckpt))
    shutil.copy(FIXTURES / "tiny-custom-voice" / "config.json", ckpt / "config.json")
    os.remove(ckpt / "speech_tokenizer" / "model.safetensors")
    with pytest.raises(WeightsError, match="neither model.safetensors nor model.safetensors.index.json"):
        Qwen3TTS.from_pretrained(str(ckpt))


def test_half_precision_loads_and_runs():
    tts = Qwen3TTS.from_pretrained(str(FIXTURES / "tiny-custom-voice"), dtype=torch.float16)
    assert tts.talker.codec_head.weight.dtype == torch.float16 and tts.decoder.pre_conv.conv.weight.dtype == torch.float16
    case = next(c for c in GOLDEN_CASES if c["name"] == "cv_en_streaming_layout")
    result = synthesize(tts, case_requests(case))[0]
    assert result.codes.shape == (23, 16) and result.audio.dtype == np.float32
    assert np.isfinite(result.audio).all()


def test_repo_id_offline_fails_fast_with_a_clear_message(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path))
    code = ("from omni_tts.models.qwen3_tts.weights import resolve_model_dir\n"
            "resolve_model_dir('Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice')\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "WeightsError" in proc.stderr and "could not be downloaded from the Hugging Face Hub" in proc.stderr


def test_bad_model_argument():
    with pytest.raises(WeightsError, match="neither a local checkpoint directory nor a Hugging Face repo id"):
        resolve_model_dir("no/such/local/path")
