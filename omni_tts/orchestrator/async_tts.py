"""The front end: what a caller in the API process uses to synthesize speech.

    async with AsyncTTS(model_dir, load_stage_config("cpu_tiny")) as engine:
        async for chunk in engine.generate(SynthesisRequest(text="Hello.", voice="ryan")):
            play(chunk.audio)            # float32 at 24 kHz; the last chunk carries `usage`

Three parts, one module each: the input processor turns a request into the talker's AddRequest
(input_processor.py), the stage client sends it and routes its audio back (stage_client.py), and the process
supervisor keeps the stage processes running (supervisor.py). Cancelling the consumer aborts the request in both
stages. While the pipeline restarts after a failure, new requests get `StageDeadError` (the server answers 503).
A request whose text arrives in pieces is a `TextStream` (`open_text_stream`).

Several models can be served at once (`AsyncTTS([ServedCheckpoint(name, dir), ...], pipeline)`): each request names
its model (`model=`, the first by default), each model has its own input processor and talker stage, and the models
whose decoders are the same share one code2wav (model_layout.py). One model's TTSClient: model_client.ModelClient.
"""
from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Callable

import numpy as np

from omni_tts.config import PipelineConfig
from omni_tts.config.settings import ApiSettings, SupervisionSettings
from omni_tts.connectors import MAX_REQUEST_ID_BYTES
from omni_tts.connectors.kinds import ConnectorSpec
from omni_tts.engine.token_limit import token_limit
from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.incremental_tokenizer import IncrementalTokenizer
from omni_tts.models.qwen3_tts.lexicon import Lexicon
from omni_tts.models.qwen3_tts.prompt import AudioInput, PromptBuilder, RequestError, SynthesisRequest
from omni_tts.models.qwen3_tts.text_tokenizer import EMPTY_INPUT, split_template
from omni_tts.stages.messages import AddRequest, AppendText, StageStats

from .input_processor import InputProcessor
from .lora_adapters import LoRAAdapters
from .model_layout import ServedCheckpoint, plan_layout
from .model_loads import ModelLoads
from .stage_client import RequestState, StageClient
from .types import SpeechChunk


class AsyncTTS:
    def __init__(self, model_dir: str | Sequence[ServedCheckpoint], pipeline: PipelineConfig,
                 supervision: SupervisionSettings = SupervisionSettings(), max_buffered_seconds: float = 60.0,
                 cpus: int | None = None, idle_unload: float | None = None, loras: Mapping[str, str] = {}) -> None:
        """model_dir: the checkpoint, or several models (the first is the default). supervision: how the stages are
        watched and restarted, and when the engine gives up. max_buffered_seconds: audio a consumer may leave
        unread before its request fails. cpus: the cores the CPU stages' threads share (default: those this process
        may run on). idle_unload: seconds after which an idle model's talker is unloaded (None: never). loras: the
        LoRA adapters (name → PEFT directory) the default model's talker loads at start-up (`adapters` loads more)."""
        self.models = ([ServedCheckpoint(os.path.basename(os.path.abspath(model_dir)), model_dir)]
                       if isinstance(model_dir, str) else list(model_dir))
        self.model_dir, self.pipeline = self.models[0].model_dir, pipeline
        self.layout = plan_layout(self.models)
        self.processors = {model.name: InputProcessor(model.model_dir, pipeline) for model in self.models}
        self.processor = self.processors[self.models[0].name]
        groups = {processor.config.talker.num_code_groups for processor in self.processors.values()}
        if len(groups) > 1:
            self._close_processors()
            raise ValueError(f"the models' codecs differ ({sorted(groups)} codebooks): serve them apart")
        self.client = StageClient(self.layout, pipeline, self.config.talker.num_code_groups, supervision,
                                  max_buffered_seconds, cpus)
        self.supervisor = self.client.supervisor
        self.loads = ModelLoads(self.client, idle_unload)
        self.adapters = LoRAAdapters(self.client, self.loads, self.layout)
        for name, path in loras.items():
            self.adapters.add_at_start(name, path, self.models[0].name)
        self.threads, self.batch_sizes = self.supervisor.threads, self.supervisor.batch_sizes

    # --- what callers read ----------------------------------------------------------------------------------
    @property
    def config(self) -> Qwen3TTSConfig:
        return self.processor.config

    @property
    def prompts(self) -> PromptBuilder:
        return self.processor.prompts

    @property
    def requests(self) -> Mapping[str, RequestState]:
        """The requests in flight, by id."""
        return self.client.requests

    @property
    def is_healthy(self) -> bool:
        return self.supervisor.is_healthy

    @property
    def down(self) -> str | None:
        return self.supervisor.down

    @property
    def down_reason(self) -> str | None:
        return self.supervisor.down_reason

    @property
    def fatal(self) -> str | None:
        return self.supervisor.fatal

    @property
    def restarts(self) -> Mapping[str, int]:
        return self.supervisor.restarts

    @property
    def on_fatal(self) -> Callable[[str], None] | None:
        """Called once when the engine gives up restarting."""
        return self.supervisor.on_fatal

    @on_fatal.setter
    def on_fatal(self, callback: Callable[[str], None] | None) -> None:
        self.supervisor.on_fatal = callback

    @property
    def connector_spec(self) -> ConnectorSpec | None:
        return self.supervisor.connector_spec

    @property
    def event_address(self) -> str | None:
        return self.supervisor.event_address

    def stage_pids(self) -> dict[str, int]:
        return self.supervisor.stage_pids()

    async def stats(self, timeout: float = 10.0) -> dict[str, StageStats]:
        return await self.client.stats(timeout)

    # --- lifecycle ------------------------------------------------------------------------------------------
    async def __aenter__(self) -> "AsyncTTS":
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def start(self) -> None:
        """Start the pipeline; raises (and cleans up) if a stage cannot start."""
        try:
            await self.client.start()
        except BaseException:
            self._close_processors()
            raise
        self.loads.start()

    async def shutdown(self) -> None:
        """Stop the stages (gracefully, then by force), fail what is in flight, close the executors."""
        self.loads.close()
        await self.client.shutdown()
        self._close_processors()

    def _close_processors(self) -> None:
        for processor in self.processors.values():
            processor.close()

    # --- models ---------------------------------------------------------------------------------------------
    def is_loaded(self, model: str | None = None) -> bool:
        """Whether the model's talker runs now (an idle one may be unloaded: `idle_unload`)."""
        return self.loads.is_loaded(self._talker(model))

    async def load_model(self, model: str | None = None) -> float:
        """Returns once the model's talker runs (loading it if it was unloaded): the seconds waited for a load."""
        return await self.loads.ready(self._talker(model))

    def _talker(self, model: str | None) -> str:
        return self.layout.talker_of[self._model_name(model)]

    def _processor(self, model: str | None) -> InputProcessor:
        return self.processors[self._model_name(model)]

    def _model_name(self, model: str | None) -> str:
        if model is None:
            return self.models[0].name
        if model not in self.processors:
            raise RequestError("model", f"model '{model}' is not served here; served: {', '.join(self.processors)}")
        return model

    # --- requests -------------------------------------------------------------------------------------------
    async def generate(self, request: SynthesisRequest, request_id: str | None = None,
                       initial_codec_chunk_frames: int | None = None, voice_version: str | None = None,
                       first_audio_timeout: float | None = None, timeout: float | None = None,
                       return_codes: bool = False, model: str | None = None,
                       lora: str | None = None) -> AsyncIterator[SpeechChunk]:
        """Stream one request's audio. RequestError for bad input (before anything runs), StageDeadError or
        RequestFailed if it cannot finish, RequestTimedOut past `first_audio_timeout` / `timeout` seconds from the
        call (the request is then aborted). Closing or cancelling the iterator aborts the request everywhere.
        initial_codec_chunk_frames overrides the connector's first-chunk size for this request. voice_version names the
        immutable clip that request.ref_audio holds (an uploaded voice's version): stage 0 caches its voice
        features under it, so the same version must never stand for other audio. return_codes: the last chunk
        carries the generated codes (`SpeechChunk.codes`), e.g. to clone this voice by ICL in a later request
        (`SynthesisRequest.ref_codes`, with this request's text as ref_text). model: the served model's name (the
        first by default); lora: one of its LoRA adapters to run with."""
        started = asyncio.get_running_loop().time()
        add = await self._prepare(request, request_id, initial_codec_chunk_frames, voice_version, text_open=False,
                                  return_codes=return_codes, model=model, lora=lora)
        state = self.client.add(add.request_id, len(add.prompt.text_ids), self._talker(model))
        chunks = self.client.outputs(state)
        try:
            await self.client.submit(state, add)
            if first_audio_timeout is not None:
                self.client.set_deadline(state, "first_audio", started + first_audio_timeout,
                                         f"no audio within {first_audio_timeout:g} s")
            if timeout is not None:
                self.client.set_deadline(state, "end", started + timeout,
                                         f"the speech did not finish within {timeout:g} s")
            async for chunk in chunks:
                yield chunk
        finally:
            await chunks.aclose()
            await self.client.release(state)

    async def open_text_stream(self, request: SynthesisRequest, request_id: str | None = None,
                               initial_codec_chunk_frames: int | None = None, voice_version: str | None = None,
                               first_audio_timeout: float | None = None, timeout: float | None = None,
                               idle_timeout: float = ApiSettings.stream_idle_timeout,
                               model: str | None = None, lora: str | None = None) -> "TextStream":
        """A request whose text arrives in pieces (request.text is ignored): `append` the text as it comes,
        `finish` it, and iterate the stream for the audio, as from `generate`, which it equals for the whole text
        in the streaming layout (non_streaming_mode None or False). The arguments are `generate`'s;
        first_audio_timeout counts from `finish`, and the request fails with RequestTimedOut when no text arrives
        for idle_timeout seconds before `finish`. RequestError for bad input; close it to abort."""
        started = asyncio.get_running_loop().time()
        add = await self._prepare(request, request_id, initial_codec_chunk_frames, voice_version, text_open=True,
                                  model=model, lora=lora)
        state = self.client.add(add.request_id, 0, self._talker(model))
        if timeout is not None:
            self.client.set_deadline(state, "end", started + timeout,
                                     f"the speech did not finish within {timeout:g} s")
        ref_frames = 0 if request.ref_codes is None else len(request.ref_codes)
        stream = TextStream(self.client, self._processor(model), state, add, ref_frames, first_audio_timeout,
                            idle_timeout, request.lexicon)
        stream.wait_for_text()
        return stream

    async def embed_voice(self, ref_audio: AudioInput, voice_version: str | None = None,
                          timeout: float = 60.0, model: str | None = None) -> np.ndarray:
        """The x-vector stage 0 computes from a clip, float32 [enc_dim]: what a Base request with this ref_audio in
        x-vector-only mode puts in its prompt, so sending it back as `speaker_embedding` gives the same audio.
        voice_version: as for `generate` (the clip's features are cached under it). RequestError for a checkpoint
        without a speaker encoder, or a clip unreadable or refused by the speaker encoder; the errors of `generate`
        otherwise."""
        self.supervisor.check_alive()
        command = await self._processor(model).embed_voice(uuid.uuid4().hex, ref_audio, voice_version)
        talker = self._talker(model)
        with self.loads.hold(talker):
            await self.loads.ready(talker)
            return await self.client.embed_voice(command, timeout, talker)

    async def abort(self, request_id: str) -> None:
        """Free the request in every stage (each drops it within one step)."""
        await self.client.abort(request_id)

    async def _prepare(self, request: SynthesisRequest, request_id: str | None,
                       initial_codec_chunk_frames: int | None, voice_version: str | None, text_open: bool,
                       return_codes: bool = False, model: str | None = None, lora: str | None = None) -> AddRequest:
        """The request for its model's talker, which runs once this returns: the caller registers the request at
        once (no await between), so an idle unload cannot come between (model_loads.py)."""
        self.supervisor.check_alive()
        rid = request_id or uuid.uuid4().hex
        self._check_new(rid)
        self.adapters.check(lora, self._model_name(model))
        add = await self._processor(model).process(rid, request, text_open, initial_codec_chunk_frames,
                                                   voice_version, return_codes)
        add.lora = lora
        await self.loads.ready(self._talker(model))
        self.supervisor.check_alive()
        self._check_new(rid)
        return add

    def _check_new(self, request_id: str) -> None:
        """Here, not in the stages: a connector chunk's header holds the id, and an id it cannot hold would fail
        the talker's loop (every request in flight); a second request under an id would take the first's state."""
        if len(request_id.encode()) > MAX_REQUEST_ID_BYTES:
            raise RequestError("request_id", f"request id longer than {MAX_REQUEST_ID_BYTES} UTF-8 bytes")
        if request_id in self.client.requests:
            raise RequestError("request_id", f"request id {request_id!r} is already in flight")


class TextStream:
    """One request whose text arrives in pieces: `append`, then `finish`; iterate for its audio. Not for concurrent
    appends. `aclose` (or leaving `async with`) aborts it unless it ended.

        stream = await engine.open_text_stream(SynthesisRequest(text="", voice="ryan"))
        await stream.append("Hello, wor")          # e.g. an LLM's tokens as they arrive
        await stream.append("ld!")
        await stream.finish()
        async for chunk in stream: ...              # concurrently with the appends

    The text is tokenized incrementally (ids as soon as no later text can change them, equal to the whole text's).
    The request enters the stages with its first text ids (AddRequest, text open); stage 0 starts it when its
    prefill's text is there, and each later piece goes as AppendText, the last with `done` and the token limit of
    the whole text.
    """

    def __init__(self, client: StageClient, processor: InputProcessor, state: RequestState, add: AddRequest,
                 ref_frames: int, first_audio_timeout: float | None, idle_timeout: float,
                 lexicon: Lexicon | None = None) -> None:
        """ref_frames: the given ICL reference codes' frames (SynthesisRequest.ref_codes), which the prompt holds.
        lexicon: the request's pronunciation aliases (SynthesisRequest.lexicon)."""
        self.client, self.processor, self.state, self.add = client, processor, state, add
        self.ref_frames = ref_frames
        self.first_audio_timeout, self.idle_timeout = first_audio_timeout, idle_timeout
        self.tokenizer = IncrementalTokenizer(processor.prompts.tokenizer)
        # the pronunciation aliases of the text that comes (a rule that spans two pieces applies: its tail waits)
        self.aliases = None if lexicon is None else lexicon.stream()
        self.ids: list[int] = []       # role ids, then text ids, as they became final
        self.in_stages = False         # its AddRequest went out
        self.text_done = False
        self.chunks = client.outputs(state)

    @property
    def request_id(self) -> str:
        return self.state.request_id

    async def append(self, text: str) -> None:
        """Add a piece of the text. RequestError when the text outgrows the talker's limits (the request fails
        with it)."""
        if self.text_done:
            raise RuntimeError("the text has been finished")
        self.wait_for_text()
        await self._send(await self.processor.tokenize(self._feed, text), done=False)

    async def finish(self) -> None:
        """End the text: what was held back goes out, with tts_eos and the whole text's token limit."""
        if self.text_done:
            return
        self.text_done = True
        ids = await self.processor.tokenize(self._finish)
        self.client.clear_deadline(self.state, "idle")
        if self.tokenizer.is_blank:
            raise self._fail(RequestError("input", EMPTY_INPUT))
        await self._send(ids, done=True)
        if self.first_audio_timeout is not None and self.state.num_samples == 0:
            self.client.set_deadline(self.state, "first_audio", _now() + self.first_audio_timeout,
                                     f"no audio within {self.first_audio_timeout:g} s of the text's end")

    def _feed(self, text: str) -> list[int]:
        return self.tokenizer.feed(text if self.aliases is None else self.aliases.feed(text))

    def _finish(self) -> list[int]:
        ids = [] if self.aliases is None else self.tokenizer.feed(self.aliases.finish())
        return ids + self.tokenizer.finish()

    def wait_for_text(self) -> None:
        """(Re)start the idle deadline: the request fails if no text comes within idle_timeout."""
        self.client.set_deadline(self.state, "idle", _now() + self.idle_timeout,
                                 f"no text for {self.idle_timeout:g} s")

    def __aiter__(self) -> AsyncIterator[SpeechChunk]:
        return self.chunks

    async def aclose(self) -> None:
        await self.chunks.aclose()
        await self.client.release(self.state)

    async def __aenter__(self) -> "TextStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _fail(self, error: RequestError) -> RequestError:
        self.client.fail(self.state, error)
        return error

    async def _send(self, ids: list[int], done: bool) -> None:
        if not self.client.is_live(self.state):
            return  # it ended (its end token came before the text's end) or failed: the audio tells which
        prompt = self.add.prompt
        num_text = len(prompt.text_ids)
        self.ids += ids
        prompt.role_ids, prompt.text_ids = split_template(self.ids, closed=False)
        new_text = prompt.text_ids[num_text:]
        try:
            self.processor.prompts.check_fits(prompt, self.ref_frames)
        except RequestError as e:
            raise self._fail(e) from None
        self.state.input_tokens = len(prompt.text_ids)
        limit = token_limit(self.add.sampling.max_new_tokens, len(prompt.text_ids))
        if self.in_stages:
            if new_text or done:
                append = AppendText(self.request_id, new_text, limit, done)
                await self.client.send(self.state, self.state.talker, append)
        elif prompt.text_ids:  # the role ids are known with the first text token
            self.in_stages = True
            self.add.max_tokens, self.add.text_open = limit, not done
            await self.client.submit(self.state, self.add)


def _now() -> float:
    return asyncio.get_running_loop().time()
