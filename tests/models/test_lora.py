"""LoRA adapter files (models/qwen3_tts/lora.py): `omni-tts make-tiny-model --variant lora` writes the PEFT layout,
`read_adapter` reads it with the scale folded into B, and every adapter this runtime cannot serve is refused by a
LoRAError naming the file and the problem."""
import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FIXTURES
from omni_tts.entrypoints.cli.commands import main as cli_main
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.lora import (CONFIG_FILE, WEIGHTS_FILE, LoRAError, merge_into, read_adapter,
                                            target_linears)
from omni_tts.models.qwen3_tts.weights import read_tensors, safetensors_files

BASE = FIXTURES / "tiny-custom-voice"
CONFIG = Qwen3TTSConfig.load(str(BASE)).talker
Q_A = "base_model.model.talker.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "a"
    assert cli_main(["make-tiny-model", str(out), "--variant", "lora", "--base", str(BASE), "--seed", "1"]) == 0
    return out


def test_the_tiny_adapter_is_a_peft_adapter_of_both_stacks(adapter_dir, tmp_path):
    config = json.loads((adapter_dir / CONFIG_FILE).read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 4
    tensors = load_file(adapter_dir / WEIGHTS_FILE)
    assert tensors[Q_A].shape == (4, 64)
    assert tensors["base_model.model.talker.code_predictor.model.layers.1.mlp.down_proj.lora_B.weight"].shape == (
        32, 4)
    assert len(tensors) == 2 * len(target_linears(CONFIG)) == 2 * 2 * 2 * 7
    # deterministic in the seed; another seed, another adapter
    again, other = tmp_path / "again", tmp_path / "other"
    assert cli_main(["make-tiny-model", str(again), "--variant", "lora", "--base", str(BASE), "--seed", "1"]) == 0
    assert cli_main(["make-tiny-model", str(other), "--variant", "lora", "--base", str(BASE), "--seed", "2"]) == 0
    assert (again / WEIGHTS_FILE).read_bytes() == (adapter_dir / WEIGHTS_FILE).read_bytes()
    assert not torch.equal(load_file(other / "adapter_model.safetensors")[Q_A], tensors[Q_A])


def test_read_folds_the_scale_into_b_and_merge_adds_b_a(adapter_dir, tmp_path):
    tensors = load_file(adapter_dir / WEIGHTS_FILE)
    config = json.loads((adapter_dir / CONFIG_FILE).read_text())
    config.update(lora_alpha=8, use_rslora=True)   # scale 8 / sqrt(4) = 4
    copy = _copy(adapter_dir, tmp_path, config=config)
    adapter = read_adapter(str(copy), CONFIG, max_rank=16)
    module = "talker.model.layers.0.self_attn.q_proj"
    a, b = adapter.weights[module]
    assert adapter.rank == 4 and len(adapter.weights) == len(target_linears(CONFIG))
    torch.testing.assert_close(a, tensors[f"base_model.model.{module}.lora_A.weight"], rtol=0, atol=0)
    torch.testing.assert_close(b, 4 * tensors[f"base_model.model.{module}.lora_B.weight"], rtol=0, atol=0)
    state = read_tensors(safetensors_files(str(BASE)), "")
    merged = merge_into(state, adapter)
    torch.testing.assert_close(merged[f"{module}.weight"], state[f"{module}.weight"].float() + b @ a)
    assert merged["talker.codec_head.weight"] is state["talker.codec_head.weight"]


def _copy(adapter_dir, tmp_path, config=None, tensors=None, name="bad"):
    """The adapter with its config and/or tensors replaced."""
    out = tmp_path / name
    shutil.copytree(adapter_dir, out)
    if config is not None:
        (out / "adapter_config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, out / "adapter_model.safetensors")
    return out


def _config_with(**changes):
    def change(config, tensors):
        return {**config, **changes}, None
    return change


def _tensors_with(edit):
    def change(config, tensors):
        tensors = dict(tensors)
        edit(tensors)
        return None, tensors
    return change


BAD = [
    # (id, change, the file the error names, its reason)
    ("rank over the maximum", _config_with(r=32, lora_alpha=32), CONFIG_FILE,
     "rank 32 exceeds the configured max_lora_rank 16"),
    ("DoRA", _config_with(use_dora=True), CONFIG_FILE, "use_dora True is not supported"),
    ("lora_bias", _config_with(lora_bias=True), CONFIG_FILE, "lora_bias True is not supported"),
    ("bias", _config_with(bias="lora_only"), CONFIG_FILE, "bias 'lora_only' is not supported"),
    ("modules_to_save", _config_with(modules_to_save=["codec_head"]), CONFIG_FILE,
     "modules_to_save ['codec_head'] is not supported"),
    ("rank_pattern", _config_with(rank_pattern={"q_proj": 8}), CONFIG_FILE, "rank_pattern {'q_proj': 8} is not"),
    ("not LoRA", _config_with(peft_type="IA3"), CONFIG_FILE, "peft_type must be LORA, got 'IA3'"),
    ("no rank", _config_with(r="four"), CONFIG_FILE, "r must be a positive integer, got 'four'"),
    ("unsupported target module", _tensors_with(lambda t: t.update({
        "base_model.model.talker.codec_head.lora_A.weight": torch.zeros(4, 64)})), WEIGHTS_FILE,
     "tensor base_model.model.talker.codec_head.lora_A.weight: not a LoRA weight of a supported target module"),
    ("embedding", _tensors_with(lambda t: t.update({
        "base_model.model.talker.model.codec_embedding.lora_embedding_A": torch.zeros(4, 3072)})), WEIGHTS_FILE,
     "not a LoRA weight of a supported target module"),
    ("a linear in the wrong block", _tensors_with(lambda t: t.update({
        "base_model.model.talker.model.layers.0.mlp.q_proj.lora_A.weight": torch.zeros(4, 64)})), WEIGHTS_FILE,
     "unsupported target module 'q_proj'"),
    ("wrong hidden size", _tensors_with(lambda t: t.update({Q_A: torch.zeros(4, 256)})), WEIGHTS_FILE,
     "talker.model.layers.0.self_attn.q_proj.lora_A.weight has shape (4, 256), this model and r=4 imply (4, 64) "
     "(an adapter for another base model?)"),
    ("a layer the model lacks", _tensors_with(lambda t: t.update({
        "base_model.model.talker.model.layers.5.mlp.up_proj.lora_A.weight": torch.zeros(4, 64),
        "base_model.model.talker.model.layers.5.mlp.up_proj.lora_B.weight": torch.zeros(128, 4)})), WEIGHTS_FILE,
     "layer 5 does not exist in this model"),
    ("half a pair", _tensors_with(lambda t: t.pop(Q_A)), WEIGHTS_FILE,
     "talker.model.layers.0.self_attn.q_proj: lora_A missing"),
    ("non-finite", _tensors_with(lambda t: t[Q_A].__setitem__((0, 0), math.nan)), WEIGHTS_FILE,
     "talker.model.layers.0.self_attn.q_proj.lora_A.weight holds non-finite values"),
    ("integer values", _tensors_with(lambda t: t.update({Q_A: torch.zeros(4, 64, dtype=torch.int32)})),
     WEIGHTS_FILE, "talker.model.layers.0.self_attn.q_proj.lora_A.weight has dtype torch.int32, not a float type"),
    ("empty", _tensors_with(lambda t: t.clear() or t.update({"other": torch.zeros(1)})), WEIGHTS_FILE,
     "tensor other: not a LoRA weight"),
]


@pytest.mark.parametrize("change,file,reason", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_adapters_name_the_file_and_the_problem(adapter_dir, tmp_path, change, file, reason):
    config = json.loads((adapter_dir / CONFIG_FILE).read_text())
    new_config, new_tensors = change(config, load_file(adapter_dir / WEIGHTS_FILE))
    bad = _copy(adapter_dir, tmp_path, new_config, new_tensors)
    with pytest.raises(LoRAError) as info:
        read_adapter(str(bad), CONFIG, max_rank=16)
    assert str(info.value).startswith(f"{bad / file}: ") and reason in str(info.value)


def test_missing_and_unreadable_files_are_named(adapter_dir, tmp_path):
    def error(path) -> str:
        with pytest.raises(LoRAError) as info:
            read_adapter(str(path), CONFIG, max_rank=16)
        return str(info.value)

    assert error(tmp_path / "nowhere") == f"{tmp_path / 'nowhere'}: no such adapter directory"
    no_config = _copy(adapter_dir, tmp_path, name="no_config")
    (no_config / CONFIG_FILE).unlink()
    assert error(no_config) == f"{no_config / CONFIG_FILE}: missing"
    pickled = _copy(adapter_dir, tmp_path, name="pickled")
    (pickled / WEIGHTS_FILE).rename(pickled / "adapter_model.bin")
    assert error(pickled).startswith(f"{pickled / WEIGHTS_FILE}: missing (adapter_model.bin is not read")
    garbled = _copy(adapter_dir, tmp_path, name="garbled")
    (garbled / CONFIG_FILE).write_text("{r: 4")
    assert error(garbled).startswith(f"{garbled / CONFIG_FILE}: not readable JSON")
    truncated = _copy(adapter_dir, tmp_path, name="truncated")
    (truncated / WEIGHTS_FILE).write_bytes((adapter_dir / WEIGHTS_FILE).read_bytes()[:100])
    assert error(truncated).startswith(f"{truncated / WEIGHTS_FILE}: not a readable safetensors file")


def test_make_tiny_model_lora_needs_a_base(tmp_path, capsys):
    assert cli_main(["make-tiny-model", str(tmp_path / "x"), "--variant", "lora"]) == 2
    assert "--variant lora needs --base DIR" in capsys.readouterr().err
