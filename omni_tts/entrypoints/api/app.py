"""The OpenAI-compatible API as one aiohttp app on one event loop over a TTS client (tts_client.TTSClient): the
orchestrator in the same process (`omni-tts serve`), or Ray Serve replicas of it (`omni-tts serve-ray`).

Routes: POST /v1/audio/speech (speech.py), POST /v1/audio/speech/batch (speech_batch.py), WS /v1/audio/speech/stream
(speech_stream.py), GET/POST /v1/audio/voices and DELETE /v1/audio/voices/{name} (voice_routes.py; a voice designed
from a prompt: voice_design.py), /v1/audio/voice_consents (voice_consents.py),
/v1/pronunciation-dictionaries (pronunciation/dictionary_routes.py), GET /v1/models, /health, /metrics, /version
(info.py), GET /openapi.json and /docs (openapi.py), GET / and /playground/{name} (playground.py), and other APIs'
routes: ElevenLabs' (elevenlabs/), WS /v1/realtime (openai_realtime/: OpenAI's Realtime API reading text aloud),
DashScope's Qwen-TTS routes (dashscope/). CPU work
(tokenizer: single worker inside the pipeline; reference audio, encoding, base64: a small bounded pool) never runs on
the loop. Each request gets an id (X-Request-Id, the pipeline's request id) and one access-log line, a WebSocket session
one per utterance and one at its end (access_log.py).
"""
from __future__ import annotations

from aiohttp import web

from omni_tts.entrypoints.api.openai_realtime import REALTIME_ROUTES
from omni_tts.entrypoints.api.openapi import openapi_routes
from omni_tts.entrypoints.api.playground import playground_routes
from omni_tts.orchestrator.tts_client import TTSClient

from .access_log import log_cut_requests, send_request_id
from .auth import SPEECH_STREAM_PATH, api_key_middleware
from .server_config import ServerConfig
from .cors import Cors
from .dashscope.qwen_routes import dashscope_routes
from .elevenlabs import ELEVENLABS_ROUTES
from .elevenlabs.stream_input import WEBSOCKET_ROUTES as ELEVENLABS_WEBSOCKET_ROUTES
from .errors import error_middleware
from .in_flight import InFlight
from .info import INFO_ROUTES
from .lora_routes import LORA_ROUTES
from .pronunciation.dictionary_routes import PRONUNCIATION_ROUTES
from .served_models import served_models
from .speech import MAX_BODY_BYTES, count_speech_requests, create_speech
from .speech_batch import create_speech_batch
from .speech_stream import speech_stream
from .state import CONFIG, TTS, STATE, ServerState
from .voice_consents import CONSENT_ROUTES
from .voice_routes import VOICE_ROUTES


def build_app(tts: TTSClient, config: ServerConfig) -> web.Application:
    """The app over `tts`, which its caller starts before serving and shuts down after (`socket_server.py`); the
    app's own cleanup closes what it made (its state, the aligner client)."""
    cors = Cors(config.allowed_origins)
    in_flight = InFlight()
    middlewares = [log_cut_requests(in_flight.why_cut), in_flight.middleware, cors.middleware(),
                   count_speech_requests, error_middleware]
    if config.api_key:
        middlewares.append(api_key_middleware(config.api_key))
    app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=middlewares, handler_args=None)
    app[TTS], app[CONFIG] = tts, config
    # a --default-voice the checkpoint lacks raises ValueError (`omni-tts serve` refuses it before its stages start)
    served_models(tts, config)

    async def shared_state(app: web.Application):
        state = app[STATE] = ServerState(tts, config, in_flight)
        if config.aligner is not None:
            state.aligner = config.aligner
            await state.aligner.start()
        yield
        if state.aligner is not None:
            await state.aligner.shutdown()
        await state.close()

    app.cleanup_ctx.append(shared_state)
    app.on_response_prepare.append(send_request_id)
    app.on_response_prepare.append(cors.add_headers)
    app.router.add_routes([
        web.post("/v1/audio/speech", create_speech),
        web.post("/v1/audio/speech/batch", create_speech_batch),
        web.get(SPEECH_STREAM_PATH, speech_stream),
        *VOICE_ROUTES,
        *CONSENT_ROUTES,
        *PRONUNCIATION_ROUTES,
        *LORA_ROUTES,
        *INFO_ROUTES,
        *REALTIME_ROUTES,
        *ELEVENLABS_ROUTES,
        *ELEVENLABS_WEBSOCKET_ROUTES,
        *openapi_routes(config.model_names, api_key_required=config.api_key is not None,
                        strict_fields=config.strict_fields),
        *playground_routes(),
        *dashscope_routes(),
    ])
    return app
