"""Golden outputs of the official Qwen3-ForcedAligner (qwen-asr 0.6) on the tiny checkpoint, for omni_tts's tests.

Run with the side virtualenv's python (setup_reference_env.sh), from the repository root:

    ~/.cache/qwen3-forced-aligner-reference/venv/bin/python tools/qwen3_forced_aligner_reference/make_goldens.py \
        tests/fixtures/qwen3_forced_aligner/tiny-forced-aligner tests/fixtures/qwen3_forced_aligner

Each case is one `Qwen3ForcedAligner.align` call on one clip (the reference pads a batch, which changes a shorter
clip's last feature frames, so a served request is compared with its own call). Written: `manifest.json` (per case
the call, the words with times, whether the encoder windows mattered) and `cases.safetensors` (per case its audio,
prompt ids, log-mel features and timestamp classes).

The reference's transformers backend drops the encoder's attention windows on its SDPA/eager paths (only flash
attention gets `cu_seqlens`); the windows are the model's design and what its vLLM backend runs. Every case is
computed both ways; `windows_matter` says whether the encoder's output differs (only past one window, 8 s), and the stored
golden is the windowed one.
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import soundfile as sf
import torch
from safetensors.numpy import save_file

from qwen_asr.core.transformers_backend import modeling_qwen3_asr as modeling
from qwen_asr.inference.qwen3_forced_aligner import Qwen3ForcedAligner

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures")
REF_VOICE = os.path.join(FIXTURES, "qwen3_tts", "ref_voice.wav")
REF_TEXT = "The quick brown fox jumps over the lazy dog."


def tone_noise(seconds: float, sr: int, seed: int, gain: float = 0.3) -> np.ndarray:
    """A deterministic stand-in for speech: a wandering tone plus noise, in syllable-like bursts, on the 16-bit grid
    (stored as int16: a test reads back exactly these float32 values)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * sr)) / sr
    pitch = 140 + 60 * np.sin(2 * np.pi * 0.7 * t + rng.uniform(0, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4.0 * t) ** 2
    wave = np.sin(2 * np.pi * np.cumsum(pitch) / sr) * envelope + 0.05 * rng.standard_normal(t.shape)
    return pcm16_grid((gain * wave).astype(np.float32))


def pcm16_grid(wav: np.ndarray) -> np.ndarray:
    return (np.round(np.clip(wav, -32768 / 32768, 32767 / 32768) * 32768) / 32768).astype(np.float32)


def resample_16k(wav: np.ndarray, sr: int) -> np.ndarray:
    import librosa
    return pcm16_grid(librosa.resample(wav, orig_sr=sr, target_sr=16000).astype(np.float32))


FEATURE_CASES = ("en_ref_voice_24k", "en_short_0s6_24k")  # the log-mel arrays are large: two cases keep them


def cases() -> list[dict]:
    voice, vsr = sf.read(REF_VOICE, dtype="float32")
    voice22, v22sr = sf.read(os.path.join(FIXTURES, "qwen3_tts", "ref_voice_22k.wav"), dtype="float32")
    return [
        dict(name="en_ref_voice_24k", audio=voice, sr=vsr, text=REF_TEXT, language="English",
             audio_file="ref_voice.wav"),
        dict(name="en_ref_voice_22k", audio=voice22, sr=v22sr, text=REF_TEXT, language="English",
             audio_file="ref_voice_22k.wav"),
        dict(name="en_ref_voice_16k", audio=resample_16k(voice, vsr), sr=16000, text=REF_TEXT, language="English"),
        dict(name="en_numbers_punctuation_16k", audio=tone_noise(4.2, 16000, 1), sr=16000,
             text="It's 3:45 on May 5th, 2026 -- the total was $1,000.50 (yes, really!) and state-of-the-art.",
             language="English"),
        dict(name="en_loud_24k", audio=3.0 * tone_noise(2.0, 24000, 2), sr=24000, gain=3.0,
             text="Loud audio is scaled down first.", language="English"),
        dict(name="en_short_0s6_24k", audio=tone_noise(0.6, 24000, 3), sr=24000, text="Hi there!",
             language="English"),
        dict(name="en_long_20s_24k", audio=np.concatenate([voice] * 6), sr=vsr,
             text=" ".join([REF_TEXT] * 6), language="English", audio_file="ref_voice.wav", repeat=6),
        dict(name="zh_16k", audio=tone_noise(3.0, 16000, 4), sr=16000, text="今天天气很好，我们去公园散步吧。",
             language="Chinese"),
        dict(name="zh_mixed_latin_digits_24k", audio=tone_noise(3.5, 24000, 5), sr=24000,
             text="我在iPhone 15上用ChatGPT写了3段代码，耗时12.5秒。", language="Chinese"),
        dict(name="ja_24k", audio=tone_noise(3.0, 24000, 6), sr=24000, text="今日はとても良い天気ですね。散歩に行きましょう。",
             language="Japanese"),
        dict(name="ko_24k", audio=tone_noise(3.0, 24000, 7), sr=24000, text="오늘은 날씨가 정말 좋네요. 공원에 산책하러 갈까요?",
             language="Korean"),
        dict(name="de_auto_24k", audio=tone_noise(2.5, 24000, 8), sr=24000, text="Über den Wolken muß die Freiheit grenzenlos sein.",
             language="auto"),
        dict(name="no_words_24k", audio=tone_noise(1.0, 24000, 9), sr=24000, text="... !!! -- ?",
             language="English"),
    ]


def run(aligner: Qwen3ForcedAligner, case: dict, windowed: bool) -> tuple[list, dict]:
    """One align call; also captures the prompt ids, features and the classes at the timestamp tokens."""
    captured: dict = {}
    thinker = aligner.model.thinker
    original_forward = thinker.forward

    def forward(**inputs):
        out = original_forward(**inputs)
        ids = inputs["input_ids"][0]
        captured["input_ids"] = ids.numpy().astype(np.int64)
        n = int(inputs["feature_attention_mask"][0].sum())
        captured["features"] = inputs["input_features"][0, :, :n].float().numpy()
        classes = out.logits.argmax(-1)[0][ids == aligner.timestamp_token_id]
        captured["classes"] = classes.numpy().astype(np.int64)
        return out

    original_layer = modeling.Qwen3ASRAudioEncoderLayer.forward

    def windowed_layer(self, hidden_states, cu_seqlens, attention_mask=None, **kwargs):
        n = hidden_states.shape[0]
        mask = torch.full([1, 1, n, n], torch.finfo(hidden_states.dtype).min, dtype=hidden_states.dtype)
        for i in range(1, len(cu_seqlens)):
            mask[..., cu_seqlens[i - 1]:cu_seqlens[i], cu_seqlens[i - 1]:cu_seqlens[i]] = 0
        return original_layer(self, hidden_states, cu_seqlens, attention_mask=mask, **kwargs)

    original_audio = thinker.get_audio_features

    def audio_features(*args, **kwargs):
        captured["encoder_output"] = original_audio(*args, **kwargs)
        return captured["encoder_output"]

    thinker.forward, thinker.get_audio_features = forward, audio_features
    if windowed:
        modeling.Qwen3ASRAudioEncoderLayer.forward = windowed_layer
    try:
        result = aligner.align(audio=(case["audio"], case["sr"]), text=case["text"], language=case["language"])[0]
    finally:
        thinker.forward, thinker.get_audio_features = original_forward, original_audio
        modeling.Qwen3ASRAudioEncoderLayer.forward = original_layer
    return [[it.text, it.start_time, it.end_time] for it in result], captured


def main(model_dir: str, out_dir: str) -> None:
    torch.manual_seed(0)
    aligner = Qwen3ForcedAligner.from_pretrained(model_dir, dtype=torch.float32)
    manifest = {"reference": "qwen-asr 0.0.6", "torch": torch.__version__, "checkpoint": os.path.basename(model_dir),
                "cases": []}
    arrays = {}
    for case in cases():
        words, captured = run(aligner, case, windowed=True)
        _, plain = run(aligner, case, windowed=False)
        entry = dict(name=case["name"], text=case["text"], language=case["language"], sample_rate=case["sr"],
                     seconds=round(len(case["audio"]) / case["sr"], 3), words=words,
                     windows_matter=not torch.equal(plain["encoder_output"], captured["encoder_output"]))
        if "audio_file" in case:  # read from tests/fixtures/qwen3_tts (soundfile, float32), repeated end to end
            entry |= dict(audio_file=case["audio_file"], repeat=case.get("repeat", 1))
        else:  # int16 here, float32 = int16 / 32768 × gain
            entry["gain"] = case.get("gain", 1.0)
            pcm = np.round(case["audio"] / entry["gain"] * 32768).astype(np.int16)
            assert np.array_equal(pcm.astype(np.float32) / 32768 * np.float32(entry["gain"]), case["audio"])
            arrays[f"{case['name']}.pcm16"] = pcm
        manifest["cases"].append(entry)
        arrays[f"{case['name']}.encoder_output"] = captured["encoder_output"].numpy()
        for key in ("input_ids", "classes") + (("features",) if case["name"] in FEATURE_CASES else ()):
            arrays[f"{case['name']}.{key}"] = np.ascontiguousarray(captured[key])
        print(f"{case['name']}: {len(words)} words, windows matter: {entry['windows_matter']}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, ensure_ascii=False, indent=1)
        f.write("\n")
    save_file(arrays, os.path.join(out_dir, "cases.safetensors"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
