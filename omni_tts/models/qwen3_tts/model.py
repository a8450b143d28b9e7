"""A loaded Qwen3-TTS-12Hz checkpoint: its configs and modules, request tokenizing and Base voice features."""
from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from .audio import SAMPLE_RATE, load_audio, resample_to
from .checkpoint_config import Qwen3TTSConfig, SpeechTokenizerConfig, read_generation_config
from .mimi_config import MimiEncoderConfig
from .prompt import AudioInput, PromptBuilder, RequestError, SynthesisRequest, TalkerPrompt, embedding_problem
from .speaker_encoder import SpeakerEncoder, extract_speaker_embedding
from .speech_decoder import SpeechDecoder
from .speech_encoder import SpeechEncoder
from .talker import Talker
from .text_tokenizer import load_text_tokenizer
from .weights import load_strict, read_tensors, resolve_model_dir, safetensors_files


def reference_audio_24k(ref_audio: AudioInput) -> np.ndarray:
    """A path, file bytes, (samples, rate) or samples at 24 kHz → float32 mono at 24 kHz; RequestError('ref_audio')
    if unreadable."""
    try:
        if isinstance(ref_audio, np.ndarray):
            wav, sr = ref_audio, SAMPLE_RATE
        else:
            wav, sr = ref_audio if isinstance(ref_audio, tuple) else load_audio(ref_audio)
        return resample_to(np.asarray(wav, dtype=np.float32), sr, SAMPLE_RATE)
    except (ValueError, OSError, RuntimeError) as e:
        raise RequestError("ref_audio", f"could not read ref_audio: {e}") from None


class Qwen3TTSWeights(nn.Module):
    """`model.safetensors`: `talker.*` (+ `speaker_encoder.*` for Base)."""

    def __init__(self, config: Qwen3TTSConfig) -> None:
        super().__init__()
        self.talker = Talker(config.talker)
        self.speaker_encoder = SpeakerEncoder(config.speaker_encoder) if config.speaker_encoder else None


class SpeechTokenizerWeights(nn.Module):
    """`speech_tokenizer/model.safetensors`: `decoder.*` and `encoder.*` (the encoder serves Base voice cloning)."""

    def __init__(self, config: SpeechTokenizerConfig, with_encoder: bool, with_decoder: bool = True) -> None:
        super().__init__()
        self.decoder = SpeechDecoder(config.decoder) if with_decoder else None
        self.encoder = (SpeechEncoder(MimiEncoderConfig.from_dict(config.encoder, config.path),
                                      config.encoder_valid_num_quantizers) if with_encoder else None)


def load_speech_tokenizer(model_dir: str, config: SpeechTokenizerConfig, device: torch.device, dtype: torch.dtype,
                          with_encoder: bool, with_decoder: bool) -> SpeechTokenizerWeights:
    """The wanted halves of `speech_tokenizer/model.safetensors`, read and loaded strictly."""
    with torch.device("meta"):
        speech = SpeechTokenizerWeights(config, with_encoder=with_encoder, with_decoder=with_decoder)
    st_dir = os.path.join(model_dir, "speech_tokenizer")
    wanted = (("encoder.",) if with_encoder else ()) + (("decoder.",) if with_decoder else ())
    st_tensors = {k: v for k, v in read_tensors(safetensors_files(st_dir), "").items() if k.startswith(wanted)}
    load_strict(speech, st_tensors, os.path.join(st_dir, "model.safetensors"), device, dtype)
    if speech.encoder is not None:
        speech.encoder.quantizer.float()  # nearest-codebook search stays fp32, as in the reference
    return speech


def load_speech_decoder(model_dir: str, device: torch.device | str = "cpu",
                        dtype: torch.dtype = torch.float32) -> SpeechDecoder:
    """The speech-tokenizer decoder alone: all the code2wav stage runs (no talker, no text tokenizer)."""
    speech = load_speech_tokenizer(model_dir, SpeechTokenizerConfig.load(model_dir), torch.device(device), dtype,
                                   with_encoder=False, with_decoder=True)
    assert speech.decoder is not None
    return speech.decoder


def decoder_fingerprint(model_dir: str) -> str:
    """A content hash of the checkpoint's speech decoder: its config and its `decoder.*` tensors (names, dtypes,
    shapes, bytes). Every Qwen3-TTS-12Hz model ships the same decoder, so checkpoints with equal fingerprints can share
    one code2wav stage; the file's hash would not do (a Base checkpoint's file holds the speech encoder too)."""
    digest = hashlib.sha256(repr(SpeechTokenizerConfig.load(model_dir).decoder).encode())
    for path in safetensors_files(os.path.join(model_dir, "speech_tokenizer")):
        with safe_open(path, framework="pt") as f:
            for key in sorted(k for k in f.keys() if k.startswith("decoder.")):
                tensor = f.get_tensor(key)
                digest.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
                digest.update(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class Qwen3TTS:
    def __init__(self, model_dir: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 with_decoder: bool = True) -> None:
        """with_decoder False: the talker side only (the talker stage has no use for the decoder)."""
        self.model_dir = model_dir
        self.device, self.dtype = torch.device(device), dtype
        self.config = Qwen3TTSConfig.load(model_dir)
        self.speech_config = SpeechTokenizerConfig.load(model_dir)
        self.generation_config: dict[str, Any] = read_generation_config(model_dir)
        self.prompts = PromptBuilder(self.config, load_text_tokenizer(model_dir))

        with torch.device("meta"):
            weights = Qwen3TTSWeights(self.config)
        load_strict(weights, read_tensors(safetensors_files(model_dir), ""),
                    os.path.join(model_dir, "model.safetensors"), self.device, dtype)
        self.talker: Talker = weights.talker
        self.talker.code_predictor.fold_embedding_projections()
        self.talker.fold_text_projection()
        self.talker.model.pack_projections()
        self.talker.code_predictor.model.pack_projections()
        self.speaker_encoder: SpeakerEncoder | None = weights.speaker_encoder
        # Base reference audio → codes needs the speech encoder
        speech = load_speech_tokenizer(model_dir, self.speech_config, self.device, dtype,
                                       with_encoder=self.config.tts_model_type == "base", with_decoder=with_decoder)
        self.decoder: SpeechDecoder | None = speech.decoder
        self.speech_encoder: SpeechEncoder | None = speech.encoder

    @classmethod
    def from_pretrained(cls, model: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                        **kwargs: Any) -> "Qwen3TTS":
        return cls(resolve_model_dir(model), device=device, dtype=dtype, **kwargs)

    @property
    def model_type(self) -> str:
        return self.config.tts_model_type

    # --- request preparation -------------------------------------------------------------------------------
    def tokenize(self, request: SynthesisRequest) -> TalkerPrompt:
        return self.prompts.tokenize(request)

    @torch.no_grad()
    def add_voice_features(self, prompt: TalkerPrompt, ref_audio: AudioInput | None) -> None:
        """Base: x-vector (and, for ICL without given reference codes, the clip's codes) from the reference audio;
        RequestError('ref_audio') for a clip that gives none the talker can use."""
        if self.model_type != "base":
            return
        wav = reference_audio_24k(ref_audio)
        embedding = extract_speaker_embedding(self.speaker_encoder, wav)
        # a finite clip can still overflow the mel spectrogram (samples far outside [-1, 1]): a NaN x-vector would
        # make the talker speak noise until its token limit
        problem = embedding_problem(self.config.speaker_encoder.enc_dim, embedding.float().cpu().numpy())
        if problem is not None:
            raise RequestError("ref_audio", f"ref_audio gives no usable speaker embedding: its x-vector {problem}")
        prompt.speaker_embedding = embedding
        if prompt.wants_clip_codes:
            prompt.ref_codes = self.speech_encoder.encode(wav)
