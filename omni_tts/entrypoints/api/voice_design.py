"""A voice designed once and kept (POST /v1/audio/voices with `type: "prompt"`, OpenAI's custom-voice shape): a served
VoiceDesign model speaks a script with the description as its instructions, greedily, as one speech request (its
checks, an admission slot, `open_speech`); the sample, as the WAV a /v1/audio/speech request for the same would
answer, is stored as a clip voice whose transcript is the script. A Base model then clones it like any uploaded
clip, so the voice's audio is exactly what cloning that sample by hand gives."""
from __future__ import annotations

import re

from omni_tts.audio.ref_audio import MAX_SECONDS
from omni_tts.voices.backend import VoiceDesign, VoiceError, validate_name

from .admission import Admission
from .responders import collect, encode_whole
from .schema import ApiError, SpeechRequest
from .served_models import ServedModel, wait_for_model
from .state import ServerState
from .synthesis import check_speech, open_speech
from .voice_schema import VoicePrompt

# greedy, and a fixed seed for the code predictor's draws should a checkpoint's defaults sample there
DESIGN_SEED = 0
# the talker's 12.5 frames a second (1920 samples a frame at 24 kHz): the sample fits a stored clip's 30 s
DESIGN_MAX_NEW_TOKENS = int((MAX_SECONDS - 1) * 12.5)
_OPENAI_MODEL = re.compile(r"auto|\d{4}-\d{2}-\d{2}")   # OpenAI's voice-creation model values: the default

# The script a voice reads when the request gives no script_hint, by the request's `language` (absent: English, the
# language of OpenAI's API, whose clients send no language). Each is a few sentences of different kinds (a greeting,
# a statement, a question, a list), about 6–10 s spoken: the length a Base model's reference clip clones best from.
DEFAULT_SCRIPTS = {
    "english": "Hello! This is my new voice. I can read you a story, answer a question, or simply wish you a good "
               "morning. Shall we begin?",
    "chinese": "你好！这是我的新声音。我可以给你讲故事、回答问题，或者简单地跟你说一声早上好。我们开始吧？",
    "japanese": "こんにちは。これは私の新しい声です。物語を読んだり、質問に答えたり、おはようと挨拶したりできます。"
                "始めましょうか？",
    "korean": "안녕하세요! 이것은 저의 새로운 목소리입니다. 이야기를 읽어 드리거나, 질문에 답하거나, 좋은 아침이라고 "
              "인사할 수 있어요. 시작할까요?",
    "german": "Hallo! Das ist meine neue Stimme. Ich kann dir eine Geschichte vorlesen, eine Frage beantworten oder "
              "einfach guten Morgen sagen. Sollen wir anfangen?",
    "french": "Bonjour ! Voici ma nouvelle voix. Je peux vous lire une histoire, répondre à une question ou "
              "simplement vous souhaiter une bonne journée. On commence ?",
    "spanish": "¡Hola! Esta es mi nueva voz. Puedo leerte una historia, responder a una pregunta o simplemente "
               "darte los buenos días. ¿Empezamos?",
    "italian": "Ciao! Questa è la mia nuova voce. Posso leggerti una storia, rispondere a una domanda o "
               "semplicemente augurarti il buongiorno. Cominciamo?",
    "portuguese": "Olá! Esta é a minha nova voz. Posso ler-te uma história, responder a uma pergunta ou "
                  "simplesmente desejar-te bom dia. Vamos começar?",
    "russian": "Здравствуйте! Это мой новый голос. Я могу прочитать вам рассказ, ответить на вопрос или просто "
               "пожелать доброго утра. Начнём?",
}


def designer_model(state: ServerState, model: str | None) -> ServedModel:
    """The VoiceDesign model a design request's `model` names; absent, "auto", a date or any name this server does
    not serve: the first served one. 400 naming `model` for a served model of another kind, naming `type` when the
    server serves no VoiceDesign model, or no Base model to speak the voice afterwards."""
    designers = state.models_of_type("voice_design")
    if not designers:
        raise ApiError(400, "a voice of type 'prompt' is designed by a VoiceDesign model; this server serves none "
                            "(upload a clip: type 'audio_sample')", "type")
    if not state.models_of_type("base"):
        raise ApiError(400, "a designed voice is spoken by a Base (voice clone) model; this server serves none",
                       "type")
    served = None if model is None or _OPENAI_MODEL.fullmatch(model) else state.config.served_model(model)
    if served is None:
        return designers[0]
    chosen = state.models[state.config.model_of(served)]
    if chosen.model_type != "voice_design":
        raise ApiError(400, f"model '{model}' is not a VoiceDesign model; voices are designed by: "
                            f"{', '.join(d.name for d in designers)}", "model")
    return chosen


def design_request(designer: ServedModel, prompt: str, script: str, language: str | None) -> SpeechRequest:
    """The speech request that speaks a designed voice's sample: what a client sends to /v1/audio/speech to hear
    it by hand."""
    return SpeechRequest(input=script, model=designer.name, instructions=prompt, language=language,
                         response_format="wav", temperature=0.0, seed=DESIGN_SEED,
                         max_new_tokens=DESIGN_MAX_NEW_TOKENS)


def design_script(script_hint: str | None, language: str | None) -> str:
    """The script a designed voice reads: the hint, else the default script of the language (400 naming
    script_hint for a language without one)."""
    if script_hint is not None:
        return script_hint.strip()
    key = "english" if language is None or language.lower() == "auto" else language.lower()
    script = DEFAULT_SCRIPTS.get("chinese" if key.endswith("_dialect") else key)   # Qwen3-TTS's dialects: Chinese
    if script is None:
        raise ApiError(400, f"no default script in language '{language}'; give script_hint", "script_hint")
    return script


async def design_sample(state: ServerState, form: VoicePrompt, request_id: str) -> tuple[bytes, str, VoiceDesign]:
    """The designed voice's sample (WAV), its script and its design (ApiError naming the field): spoken in an
    admission slot, as a speech request is."""
    try:
        validate_name(form.name)   # before the work, not after it
    except VoiceError as e:
        raise ApiError(e.status, str(e), e.param) from None
    designer = designer_model(state, form.model)
    script = design_script(form.script_hint, form.language)
    speech = design_request(designer, form.prompt.strip(), script, form.language)
    voice = await check_speech(state, speech)
    with Admission(state) as admission:
        await wait_for_model(designer)
        async with open_speech(state, speech, voice, request_id, admission) as (first, stream):
            parts, last = await collect(first, stream)
    if last.usage.finish_reason == "length":   # cut short: the clip would not say its transcript
        raise ApiError(400, f"the script takes longer than {MAX_SECONDS - 1:g} s to speak; give a shorter "
                            "script_hint", "script_hint")
    sample, _ = await encode_whole(state, speech, parts)
    return sample, script, VoiceDesign(speech.instructions, designer.name)
