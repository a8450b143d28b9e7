"""From a speech request's options (HTTP body or WebSocket session.config) to the pipeline's SynthesisRequest: the
checks that cost nothing, made before admission, then the request with its reference audio, built after it, and
its audio stream opened (`open_speech`, for the routes that answer one HTTP request per synthesis request)."""
from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from omni_tts.audio.encoding import output_sample_rate
from omni_tts.audio.ref_audio import RefAudioError, fetch_ref_audio
from omni_tts.entrypoints.api.names import VoiceChoice, unknown_uploaded_voice
from omni_tts.entrypoints.api.schema import ApiError, SpeechOptions, SpeechRequest
from omni_tts.voices.store import VoiceError
from omni_tts.models.qwen3_tts.lexicon import Lexicon
from omni_tts.models.qwen3_tts.prompt import RequestError, SynthesisRequest, check_speaker_embedding
from omni_tts.models.qwen3_tts.sampling_params import SamplingParams
from omni_tts.orchestrator.types import SpeechChunk

from .admission import Admission
from .state import ServerState


def check_output(options: SpeechOptions, streaming: bool) -> None:
    """The output options a response can honour: the format's sample rates (every format streams; a speed change
    does not)."""
    try:
        output_sample_rate(options.response_format, options.sample_rate)
    except ValueError as e:
        raise ApiError(400, str(e), "sample_rate") from None
    if streaming and options.speed != 1.0:
        raise ApiError(400, "speed must be 1.0 for streaming responses (time-stretching needs the whole "
                            "utterance); send a non-streaming request to change the speed", "speed")


async def check_speech_request(state: ServerState, speech: SpeechOptions) -> VoiceChoice:
    """What can be refused without work, before admission: the model name, the voice (one decision, names.py) and
    the fields this checkpoint cannot take. Whether the voice is an uploaded one is asked of the store in its read
    pool: a file system's stat may hang (NFS), never the event loop."""
    model = state.served_model(speech.model)
    config = model.config
    if speech.instructions and config.tts_model_type == "custom_voice" and config.tts_model_size == "0b6":
        raise ApiError(400, "instructions are not supported by 0.6B CustomVoice checkpoints", "instructions")
    if speech.ref_audio is not None and config.tts_model_type != "base":
        raise ApiError(400, "ref_audio is only supported by Base (voice clone) models", "ref_audio")
    if speech.speaker_embedding is not None:
        try:
            check_speaker_embedding(config, speech.speaker_embedding, ref_audio=speech.ref_audio is not None,
                                    ref_text=bool((speech.ref_text or "").strip()))
        except RequestError as e:
            raise ApiError(400, str(e), e.param) from None
    reference = ("ref_audio" if speech.ref_audio is not None else
                 "speaker_embedding" if speech.speaker_embedding is not None else None)
    name, voices = speech.voice_name, state.voices
    uploaded = set()
    if voices is not None:   # the name, and the uploaded voice it may be an alias of
        for candidate in {n for n in (name, model.voice_names.alias(name)) if n is not None}:
            if await state.run_voices(voices.__contains__, candidate):
                uploaded.add(candidate)
    voice = model.voice_names.choose(name, reference, uploaded.__contains__)
    pronunciation_lexicon(state, speech, voice)   # a locator that finds nothing is refused here
    return voice


def pronunciation_lexicon(state: ServerState, speech: SpeechOptions, voice: VoiceChoice) -> Lexicon | None:
    """The alias rules of the request's pronunciation dictionaries, its voice's and the server's."""
    return state.pronunciation.lexicon_for(speech.pronunciation_dictionary_locators, voice.speaker or voice.uploaded)


async def check_speech(state: ServerState, speech: SpeechRequest) -> VoiceChoice:
    """Every check of a /v1/audio/speech body before admission (each item of the batch route's too)."""
    check_output(speech, speech.streaming)
    if not speech.input.strip():
        raise ApiError(400, "input must not be empty", "input")
    if len(speech.input) > state.config.max_input_chars:
        raise ApiError(400, f"input is {len(speech.input)} characters; this server takes at most "
                            f"{state.config.max_input_chars} (--max-input-chars)", "input")
    return await check_speech_request(state, speech)


async def build_synthesis_request(state: ServerState, speech: SpeechOptions, voice: VoiceChoice,
                                  text: str) -> tuple[SynthesisRequest, str | None]:
    """The synthesis request for `text`, and the uploaded voice's version key when ref_audio comes from one (an
    embedding voice's x-vector needs no cache). Fetches and decodes reference audio: call it only once the request
    is admitted."""
    ref_audio, ref_text, voice_version = None, speech.ref_text, None
    x_vector_only, embedding = speech.x_vector_only_mode, speech.speaker_embedding
    if speech.ref_audio is not None:
        try:
            samples = await fetch_ref_audio(speech.ref_audio, fetcher=state.fetcher, executor=state.pool,
                                            allowed_local_path=state.config.allowed_local_media_path)
            ref_audio = samples  # decoded at 24 kHz: the pipeline takes it as it is
        except RefAudioError as e:
            raise ApiError(e.status, str(e), "ref_audio") from None
    elif voice.uploaded is not None:
        try:  # one version, looked up and read whole, whatever uploads and deletes happen meanwhile
            loaded = await state.run_voices(state.voices.load, voice.uploaded)
        except VoiceError as e:
            raise ApiError(e.status, str(e), "voice") from None
        if loaded is None:  # deleted since the request was checked
            raise unknown_uploaded_voice(voice.uploaded)
        record, loaded_voice = loaded
        if record.embedding_dim is not None:  # a voice saved as an x-vector: no clip, so no ICL
            try:
                config = state.served_model(speech.model).config
                embedding = check_speaker_embedding(config, loaded_voice, ref_audio=False,
                                                    ref_text=bool((ref_text or "").strip()))
            except RequestError as e:
                raise ApiError(400, f"voice '{record.name}' is a speaker embedding: {e}", "voice") from None
        else:
            ref_audio = loaded_voice
            voice_version = record.voice_version
            if ref_text is None:
                ref_text = record.ref_text
            x_vector_only = x_vector_only or not ref_text
    synthesis = SynthesisRequest(
        text=text, task_type=speech.task_type, voice=voice.speaker, language=speech.language,
        instructions=speech.instructions, ref_audio=ref_audio, ref_text=ref_text, x_vector_only=x_vector_only,
        speaker_embedding=embedding, non_streaming_mode=speech.non_streaming_mode,
        sampling=SamplingParams.of(speech), lexicon=pronunciation_lexicon(state, speech, voice))
    return synthesis, voice_version


@contextlib.asynccontextmanager
async def open_speech(state: ServerState, speech: SpeechRequest, voice: VoiceChoice, request_id: str,
                      admission: Admission) -> AsyncIterator[tuple[SpeechChunk, AsyncIterator[SpeechChunk]]]:
    """An admitted request's first audio and the stream of the rest. A pipeline error before the first audio is
    raised here; however the caller's block ends, the stream is closed, which aborts the request in every stage if
    it did not finish."""
    stream = None
    try:
        synthesis, voice_version = await build_synthesis_request(state, speech, voice, speech.input)
        stream = state.served_model(speech.model).tts.generate(synthesis, request_id=request_id,
                                       initial_codec_chunk_frames=speech.initial_codec_chunk_frames,
                                       voice_version=voice_version,
                                       first_audio_timeout=state.config.first_audio_timeout,
                                       timeout=state.config.request_timeout)
        first = await anext(stream)
        admission.first_audio()
        yield first, stream
    finally:
        if stream is not None:
            await stream.aclose()
