"""Requests → talker prompts (model doc §6–§7).

Two steps, so the server can run them in different places: `PromptBuilder.tokenize` is tokenizer-bound CPU work
(validation + text ids); `embed_prompt` turns a `TalkerPrompt` into the prefill rows and the trailing text rows
on the talker's device.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch
from tokenizers import Tokenizer

from .checkpoint_config import Qwen3TTSConfig
from .device_copy import to_device
from .lexicon import Lexicon
from .sampling import SamplingParams
from .talker import Talker
from .text_tokenizer import EMPTY_INPUT, TEMPLATE_HEAD, TEMPLATE_TAIL, split_template, strip_leading_newlines

logger = logging.getLogger(__name__)

# user-facing task type → checkpoint `tts_model_type`
TASK_TYPES = {"CustomVoice": "custom_voice", "VoiceDesign": "voice_design", "Base": "base"}
AudioInput = str | bytes | tuple[np.ndarray, int] | np.ndarray   # an array: float32 mono samples at 24 kHz
# the largest |value| a sent speaker embedding may hold: room to spare for mixed and scaled x-vectors, while a
# vector that is no x-vector (raw int16 samples, say) is refused rather than summed, as a prompt row, with the text
# rows of a half-precision talker
MAX_EMBEDDING_ABS = 1e3


class RequestError(ValueError):
    """A request that cannot be served as given; `param` names the offending field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # pickled whole: serve-ray sends it from a replica to the API process
        return type(self), (self.param, str(self))


@dataclass
class SynthesisRequest:
    text: str
    task_type: str | None = None          # CustomVoice | VoiceDesign | Base; None = the checkpoint's
    voice: str | None = None              # CustomVoice speaker name
    language: str | None = None           # None = Auto
    instructions: str | None = None
    ref_audio: AudioInput | None = None   # Base: path, file bytes, (samples, sample_rate) or 24 kHz samples
    ref_text: str | None = None           # ICL: the transcript of ref_audio (or of ref_codes' audio)
    x_vector_only: bool = False
    speaker_embedding: Sequence[float] | np.ndarray | None = None   # Base: the x-vector itself, instead of ref_audio
    # ICL reference as codec codes [T, num_code_groups] instead of audio (e.g. an earlier request's output), with
    # ref_text; VoiceDesign (beside the instructions) or Base (the x-vector still from ref_audio or speaker_embedding)
    ref_codes: np.ndarray | None = None
    non_streaming_mode: bool | None = None  # None = the variant's default (§7.3)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # pronunciation aliases, applied to `text` (whole or streamed) before it is tokenized (input_processor.py)
    lexicon: Lexicon | None = None


class TalkerPrompt(msgspec.Struct, omit_defaults=True):
    """Everything the prefill needs, as ids and (for Base) voice features. The ids cross to the talker stage inside
    its AddRequest; the voice features are computed there (they are None on the wire)."""
    role_ids: list[int]
    text_ids: list[int]
    instruct_ids: list[int]
    language_id: int | None
    speaker_id: int | None                  # CustomVoice: codec-embedding row of the speaker
    non_streaming: bool
    ref_text_ids: list[int] | None = None   # ICL
    speaker_embedding: torch.Tensor | None = None  # Base: x-vector [H]
    ref_codes: torch.Tensor | None = None   # ICL: [T_ref, 16] int64

    @property
    def is_icl(self) -> bool:
        return self.ref_codes is not None

    @property
    def wants_clip_codes(self) -> bool:
        """ICL whose reference codes are still to be computed from the reference clip (none were given)."""
        return self.ref_text_ids is not None and self.ref_codes is None

    @property
    def prefill_text_tokens(self) -> int:
        """Text tokens the streaming layout's prefill holds (§7.2): the first, or for ICL as many as the reference
        has codec frames + 1, less the ref_text tokens. A request whose text is still arriving starts with them."""
        if self.is_icl:
            return max(0, 1 + self.ref_codes.shape[0] - len(self.ref_text_ids))
        return 1


# prompt rows besides the text: role (3), codec tag (≤ 4), speaker (1), pad/bos (1), tts_eos and codec_bos (2)
_CONTROL_ROWS = 11
# the fewest rows a prompt has (the streaming layout without instructions, language or speaker row: role (3), codec
# tag (3), pad/bos (1), the first text token (1)); a language adds a tag row, a CustomVoice speaker or x-vector one
MIN_PROMPT_ROWS = 8


@dataclass(frozen=True)
class PromptLimits:
    """The talker stage's per-request bounds (stage config), checked when a request is tokenized and again in the
    stage once a reference clip's frames are known: a request over them is a RequestError naming its field."""
    max_text_tokens: int  # input text tokens, plus ref_text tokens for ICL cloning (both trail the prompt)
    max_model_len: int    # prompt rows + generated tokens

    def check_fits(self, prompt: TalkerPrompt, ref_frames: int = 0, ref_param: str = "ref_codes") -> None:
        """RequestError naming the field if the prompt exceeds the limits. ref_frames: the ICL reference's codec
        frames, from `ref_param` (the given ref_codes, or in the stage the ref_audio clip's)."""
        text_ids, ref_text_ids, instruct_ids = prompt.text_ids, prompt.ref_text_ids or [], prompt.instruct_ids
        if len(text_ids) > self.max_text_tokens:
            raise RequestError("input", f"input is {len(text_ids)} text tokens; the limit is {self.max_text_tokens}")
        if len(ref_text_ids) + len(text_ids) > self.max_text_tokens:
            raise RequestError("ref_text", f"ref_text ({len(ref_text_ids)} text tokens) and input "
                                           f"({len(text_ids)}) exceed the limit of {self.max_text_tokens} together")
        # an upper bound of the prompt rows (streaming layouts hold fewer)
        rows = len(instruct_ids) + len(ref_text_ids) + len(text_ids) + ref_frames + _CONTROL_ROWS
        if rows >= self.max_model_len:
            param = (ref_param if rows - ref_frames < self.max_model_len else
                     "instructions" if instruct_ids else "input")
            raise RequestError(param, f"the prompt ({rows} rows with {len(instruct_ids)} instruction tokens and "
                                      f"{ref_frames} reference frames) leaves no room to generate within "
                                      f"max_model_len {self.max_model_len}")


def check_speaker_embedding(config: Qwen3TTSConfig, values: Sequence[float] | np.ndarray, *, ref_audio: bool,
                            ref_text: bool, ref_codes: bool = False) -> np.ndarray:
    """A sent x-vector as float32 [enc_dim], or RequestError('speaker_embedding'): Base checkpoints only, exactly
    the speaker encoder's output size, finite, |v| <= MAX_EMBEDDING_ABS; it is the voice, so ref_audio may not come
    with it, nor ref_text unless ref_codes do (ICL needs reference codes: a clip's, or given ones)."""
    def refuse(message: str) -> RequestError:
        return RequestError("speaker_embedding", message)

    if config.tts_model_type != "base" or config.speaker_encoder is None:
        raise refuse(f"speaker_embedding is only supported by Base (voice clone) models; this one is "
                     f"{config.tts_model_type}")
    vector = np.asarray(values, dtype=np.float64)
    problem = embedding_problem(config.speaker_encoder.enc_dim, vector)
    if problem is not None:
        raise refuse(f"speaker_embedding {problem}")
    if ref_audio:
        raise refuse("speaker_embedding is the voice: give it or ref_audio (or an uploaded voice), not both")
    if ref_text and not ref_codes:
        raise refuse("speaker_embedding means x-vector-only cloning, which takes no ref_text (ICL needs "
                     "ref_audio)")
    return vector.astype(np.float32)


def embedding_problem(size: int, vector: np.ndarray) -> str | None:
    """Why `vector` is no x-vector of a speaker encoder of output `size` (a sent one, or one computed from a clip),
    as a predicate ("must ..."), or None: exactly `size` values, finite, |v| <= MAX_EMBEDDING_ABS."""
    if vector.ndim != 1 or vector.shape[0] != size:
        return (f"must be a list of {size} numbers (this checkpoint's speaker encoder size), got "
                f"{vector.shape[0] if vector.ndim == 1 else 'a nested list'}")
    if not np.isfinite(vector).all():
        return "must hold finite numbers (no NaN or infinity)"
    if vector.size and np.abs(vector).max() > MAX_EMBEDDING_ABS:
        return f"values must lie within ±{MAX_EMBEDDING_ABS:g}"
    return None


def check_ref_codes(config: Qwen3TTSConfig, values: object) -> np.ndarray:
    """Given ICL reference codes as int64 [T, num_code_groups], or RequestError('ref_codes'): VoiceDesign and Base
    checkpoints only (a CustomVoice voice is its speaker), at least one frame, every code within the codebook."""
    def refuse(message: str) -> RequestError:
        return RequestError("ref_codes", message)

    if config.tts_model_type not in ("voice_design", "base"):
        raise refuse(f"ref_codes are only supported by VoiceDesign and Base models; this one is "
                     f"{config.tts_model_type}")
    groups, size = config.talker.num_code_groups, config.talker.code_predictor.vocab_size
    try:
        codes = np.asarray(values)
    except (ValueError, TypeError):  # ragged lists
        codes = None
    if codes is None or codes.ndim != 2 or codes.shape[1] != groups or codes.shape[0] < 1:
        raise refuse(f"ref_codes must be a list of frames of {groups} codes each (at least one frame), got "
                     f"{'a ragged list' if codes is None else f'shape {list(codes.shape)}'}")
    if not np.issubdtype(codes.dtype, np.integer):
        raise refuse(f"ref_codes must hold integers, got {codes.dtype}")
    if codes.min() < 0 or codes.max() >= size:
        raise refuse(f"ref_codes must lie in 0..{size - 1} (the codebook size is {size})")
    return codes.astype(np.int64)


class PromptBuilder:
    def __init__(self, config: Qwen3TTSConfig, tokenizer: Tokenizer, limits: PromptLimits | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.limits = limits

    @property
    def speakers(self) -> list[str]:
        return sorted(self.config.talker.spk_id)

    @property
    def languages(self) -> list[str]:
        # dialect ids are chosen through the speaker, never requested directly
        return ["auto"] + sorted(k for k in self.config.talker.codec_language_id if "dialect" not in k)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def text_ids(self, text: str) -> list[int]:
        """The text tokens `tokenize` takes from `text` (what max_text_tokens counts)."""
        return split_template(self._encode(TEMPLATE_HEAD + strip_leading_newlines(text) + TEMPLATE_TAIL))[1]

    def tokenize(self, request: SynthesisRequest, text_open: bool = False) -> TalkerPrompt:
        """Validate the request against the checkpoint and tokenize it (voice features are filled in later).
        text_open: its text arrives later, in pieces (IncrementalTokenizer gives the role and text ids): the prompt
        has none yet, and the layout is the streaming one."""
        cfg, talker = self.config, self.config.talker
        model_type = cfg.tts_model_type
        if request.task_type is not None:
            if request.task_type not in TASK_TYPES:
                raise RequestError("task_type", f"unknown task_type {request.task_type!r}; expected one of "
                                                f"{', '.join(TASK_TYPES)}")
            if TASK_TYPES[request.task_type] != model_type:
                expected = next(k for k, v in TASK_TYPES.items() if v == model_type)
                raise RequestError("task_type", f"task_type {request.task_type!r} does not match the loaded "
                                                f"{expected} checkpoint")
        role_ids, text_ids = [], []
        if not text_open:
            text = strip_leading_newlines(request.text or "")
            if not text.strip():
                raise RequestError("input", EMPTY_INPUT)
            ids = self._encode(TEMPLATE_HEAD + text + TEMPLATE_TAIL)
            role_ids, text_ids = split_template(ids)

        speaker = (request.voice or "").strip().lower() or None
        instructions = request.instructions or None
        if model_type == "custom_voice":
            if speaker is None:
                raise RequestError("voice", f"voice is required for CustomVoice; available: {', '.join(self.speakers)}")
            if speaker not in talker.spk_id:
                raise RequestError("voice", f"unknown voice {request.voice!r}; available: {', '.join(self.speakers)}")
            if instructions and cfg.tts_model_size == "0b6":
                logger.warning("instructions are not supported by 0.6B CustomVoice checkpoints; ignored")
                instructions = None
        elif speaker is not None:
            raise RequestError("voice", f"voice {request.voice!r} is not supported by {model_type} checkpoints"
                                        + ("; give ref_audio instead" if model_type == "base" else ""))
        if model_type == "base" and instructions:
            raise RequestError("instructions", "instructions are not supported by Base (voice clone) checkpoints")

        language = (request.language or "auto").strip().lower()
        if language not in self.languages:
            raise RequestError("language", f"unsupported language {request.language!r}; supported: "
                                           f"{', '.join(self.languages)}")
        language_id = None if language == "auto" else talker.codec_language_id[language]
        dialect = talker.spk_is_dialect.get(speaker) if speaker else False
        if language in ("chinese", "auto") and dialect:
            if dialect not in talker.codec_language_id:
                raise RequestError("voice", f"voice {request.voice!r} names dialect {dialect!r}, which the "
                                            "checkpoint has no language id for")
            language_id = talker.codec_language_id[dialect]

        ref_frames = 0
        if request.ref_codes is not None:
            ref_frames = check_ref_codes(cfg, request.ref_codes).shape[0]
            if request.x_vector_only:
                raise RequestError("ref_codes", "ref_codes are an ICL reference, which x_vector_only mode does not "
                                                "take")
        ref_text = (request.ref_text or "").strip()
        if request.speaker_embedding is not None:
            check_speaker_embedding(cfg, request.speaker_embedding, ref_audio=request.ref_audio is not None,
                                    ref_text=bool(ref_text), ref_codes=request.ref_codes is not None)
        elif model_type == "base" and request.ref_audio is None:
            raise RequestError("ref_audio", "ref_audio is required for Base (voice clone) checkpoints, or a "
                                            "speaker_embedding")
        ref_text_ids = None
        if request.ref_codes is not None or (model_type == "base" and request.speaker_embedding is None
                                             and not request.x_vector_only):
            if not ref_text:
                raise RequestError("ref_text", "ref_text is required with ref_codes (the transcript of their audio)"
                                   if request.ref_codes is not None else
                                   "ref_text is required for voice cloning unless x_vector_only mode is set")
            ref_text_ids = self._encode(f"<|im_start|>assistant\n{request.ref_text}<|im_end|>\n")[3:-2]
        non_streaming = request.non_streaming_mode
        if text_open and non_streaming:
            raise RequestError("non_streaming_mode", "text that arrives in pieces needs the streaming layout "
                                                     "(non_streaming_mode false)")
        if non_streaming is None:
            non_streaming = model_type != "base" and not text_open
        instruct_ids = self._encode(f"<|im_start|>user\n{instructions}<|im_end|>\n") if instructions else []
        prompt = TalkerPrompt(role_ids=role_ids, text_ids=text_ids, instruct_ids=instruct_ids, language_id=language_id,
                              speaker_id=talker.spk_id[speaker] if model_type == "custom_voice" else None,
                              non_streaming=non_streaming, ref_text_ids=ref_text_ids)
        self.check_fits(prompt, ref_frames)
        return prompt

    def check_fits(self, prompt: TalkerPrompt, ref_frames: int = 0) -> None:
        """RequestError naming the field if the prompt exceeds the talker's limits (a text that arrives in pieces is
        checked as it grows). ref_frames: the given ICL reference codes' frames (a clip's are not known yet: the
        stage checks them)."""
        if self.limits is not None:
            self.limits.check_fits(prompt, ref_frames)


@torch.no_grad()
def embed_prompt(talker: Talker, config: Qwen3TTSConfig, prompt: TalkerPrompt,
                 text_done: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill rows [L, H] and trailing text rows [T, H] (fed one per decode step, then tts_pad), §7.
    text_done False: the text goes on (streaming layout, at least `prefill_text_tokens` of it): the trailing rows
    stop at the text so far, without tts_eos; the rest follows as `embed_text` rows."""
    tc = config.talker
    device = talker.codec_head.weight.device

    def ids(values: list[int]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.long), device)

    def text(values: list[int]) -> torch.Tensor:
        return text_rows(talker, values)

    def codec(values: list[int]) -> torch.Tensor:
        return talker.embed_codec(ids(values))

    tts_bos, tts_eos, tts_pad = text([config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id])
    tag = ([tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id] if prompt.language_id is None else
           [tc.codec_think_id, tc.codec_think_bos_id, prompt.language_id, tc.codec_think_eos_id])
    codec_rows = [codec(tag)]
    if prompt.speaker_id is not None:
        codec_rows.append(codec([prompt.speaker_id]))
    elif prompt.speaker_embedding is not None:
        codec_rows.append(to_device(prompt.speaker_embedding, device).to(tts_pad.dtype)[None])
    codec_prefix = torch.cat(codec_rows)
    head = [text(prompt.instruct_ids)] if prompt.instruct_ids else []
    head += [text(prompt.role_ids), codec_prefix + tts_pad, (codec([tc.codec_pad_id]) + tts_bos)]

    if not text_done and (prompt.non_streaming or len(prompt.text_ids) < prompt.prefill_text_tokens):
        raise ValueError("a prompt whose text goes on needs the streaming layout and its prefill's text tokens")
    end = [tts_eos[None]] if text_done else []
    if prompt.is_icl:
        tt = torch.cat([text(prompt.ref_text_ids + prompt.text_ids)] + end)
        cc = torch.cat([codec([tc.codec_bos_id]), talker.embed_frame(to_device(prompt.ref_codes, device))])
        if prompt.non_streaming:
            body = [tt + codec([tc.codec_pad_id]), cc + tts_pad]
            trailing = tts_pad[None]
        elif len(tt) > len(cc) or not text_done:  # open text: more rows trail
            body, trailing = [tt[:len(cc)] + cc], tt[len(cc):]
        else:
            padded = torch.cat([tt, tts_pad.expand(len(cc) - len(tt), -1)])
            body, trailing = [padded + cc], tts_pad[None]
    elif prompt.non_streaming:
        rows = torch.cat([text(prompt.text_ids), tts_eos[None]]) + codec([tc.codec_pad_id])
        body = [rows, tts_pad[None] + codec([tc.codec_bos_id])]
        trailing = tts_pad[None]
    else:
        first = text(prompt.text_ids[:1]) + codec([tc.codec_bos_id])
        body = [first]
        trailing = torch.cat([text(prompt.text_ids[1:])] + end)
    return torch.cat(head + body), trailing


@torch.no_grad()
def embed_text(talker: Talker, config: Qwen3TTSConfig, text_ids: list[int], text_done: bool) -> torch.Tensor:
    """The trailing rows [k, H] for more text of a request whose text goes on (+ tts_eos at its end)."""
    return text_rows(talker, text_ids + ([config.tts_eos_token_id] if text_done else []))


def text_rows(talker: Talker, ids: list[int]) -> torch.Tensor:
    """T(id) [n, H]: with the folded text table (Talker.fold_text_projection, as loaded), one lookup however many,
    and a text cut into pieces gets the whole text's bits."""
    return talker.embed_text(to_device(torch.tensor(ids, dtype=torch.long), talker.codec_head.weight.device))
