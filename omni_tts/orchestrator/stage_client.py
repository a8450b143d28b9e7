"""The stage client: commands to the stage processes (msgspec msgpack over the supervisor's sockets), their events
decoded and routed to each request's stream, and each request's state and deadlines.

A request's path: Register in stage 1, then AddRequest to stage 0 (`submit`) → AudioEvents queued for its
consumer (`outputs`) → the final usage once stage 0 reported the frame count and stage 1 the last audio. A consumer
slower than its audio by more than `max_buffered_seconds` is failed (RequestFailed), so no request can make the
server buffer a whole utterance. A request that fails is aborted in both stages; a pipeline failure fails them all.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import numpy as np

from omni_tts.config import PipelineConfig
from omni_tts.config.settings import SupervisionSettings
from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE
from omni_tts.models.qwen3_tts.prompt import RequestError
from omni_tts.stages.messages import (Abort, AddRequest, AudioEvent, EmbedVoice, GetStats, Heartbeat, LoadLoRA,
                                      LoRALoaded, LoRAUnloaded, Ready, Register, StageCommand, StageEvent,
                                      StageFailed, StageStats, TalkerDone, UnloadLoRA, VoiceEmbedding)

from .model_layout import PipelineLayout
from .supervisor import StageSupervisor
from .types import EngineShutDown, RequestFailed, RequestTimedOut, SpeechChunk, StageDeadError, Usage, stage_error


@dataclass
class RequestState:
    request_id: str
    queue: asyncio.Queue       # SpeechChunks, then the usage chunk or the error that ends the request
    input_tokens: int
    epoch: int                 # the pipeline it runs in (StageSupervisor.epoch)
    talker: str = "talker"     # its model's talker stage (model_layout.py)
    num_samples: int = 0
    buffered_samples: int = 0  # queued, not yet taken by the consumer
    talker_done: TalkerDone | None = None
    audio_done: bool = False
    deadlines: dict[str, asyncio.TimerHandle] = field(default_factory=dict)   # by name; each fails the request
    released: bool = False


class StageClient:
    def __init__(self, layout: PipelineLayout, pipeline: PipelineConfig, num_code_groups: int,
                 supervision: SupervisionSettings, max_buffered_seconds: float, cpus: int | None) -> None:
        """layout, supervision, cpus: StageSupervisor's."""
        self.max_buffered_samples = int(max_buffered_seconds * SAMPLE_RATE)
        self.last_audio_timeout = supervision.last_audio_timeout
        self.num_code_groups = num_code_groups
        self.layout = layout
        self.supervisor = StageSupervisor(layout, pipeline, num_code_groups, self._on_event, self.fail_all,
                                          supervision, cpus)
        self.requests: dict[str, RequestState] = {}
        self.pending_aborts: set[asyncio.Task] = set()   # the aborts of failed requests, held until they ran
        self._stats: dict[str, asyncio.Future] = {}     # stage → its StageStats, for the round trip in flight
        self._stats_round: asyncio.Future | None = None   # that round trip, which concurrent stats() calls share
        self._embeddings: dict[str, asyncio.Future] = {}   # EmbedVoice id → its answer
        self._lora_answers: dict[tuple[str, str], asyncio.Future] = {}   # (LoadLoRA | UnloadLoRA, name) → its answer
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(StageEvent)

    async def start(self) -> None:
        await self.supervisor.start()

    async def shutdown(self) -> None:
        # what is in flight fails first: its consumers end at once rather than after the stages have stopped
        self.fail_all(EngineShutDown("the engine is shutting down"))
        await self.supervisor.shutdown()

    # --- requests -------------------------------------------------------------------------------------------
    def add(self, request_id: str, input_tokens: int, talker: str = "talker") -> RequestState:
        """A request of the model whose talker stage is `talker`."""
        state = self.requests[request_id] = RequestState(request_id, asyncio.Queue(), input_tokens,
                                                         self.supervisor.epoch, talker)
        return state

    def is_live(self, state: RequestState) -> bool:
        """Neither ended nor failed."""
        return self.requests.get(state.request_id) is state

    async def submit(self, state: RequestState, add: AddRequest) -> None:
        """Register the request in its code2wav, then add it to its talker."""
        await self.send(state, self.layout.decoder_of[state.talker], Register(state.request_id))
        await self.send(state, state.talker, add)
        if not self.is_live(state):  # failed while being sent: its Abort may have gone first
            await self.abort(state.request_id)

    async def send(self, state: RequestState, stage: str, command: StageCommand) -> None:
        await self.supervisor.send(stage, self._encoder.encode(command), state.epoch)

    async def abort(self, request_id: str) -> None:
        """Free the request in every stage (each drops it within one step)."""
        message = self._encoder.encode(Abort(request_id))
        epoch = self.supervisor.epoch
        for stage in self.supervisor.stages:
            try:
                await self.supervisor.send(stage, message, epoch)
            except StageDeadError:
                pass

    async def outputs(self, state: RequestState) -> AsyncIterator[SpeechChunk]:
        """The request's chunks until its usage; the failure that ends it is raised (it left the stages)."""
        finished = False
        try:
            while True:
                item = await state.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # its failure removed it from the stages (or the pipeline)
                    raise item
                state.buffered_samples -= item.audio.shape[0]
                yield item
                if item.usage is not None:
                    finished = True
                    return
        finally:
            await self.release(state, abort=not finished)

    async def release(self, state: RequestState, abort: bool = True) -> None:
        """The request leaves (once): its deadlines are off and, unless it ended, both stages drop it."""
        if state.released:
            return
        state.released = True
        if self.is_live(state):
            del self.requests[state.request_id]
        self._cancel_deadlines(state)
        if abort and state.epoch == self.supervisor.epoch and self.supervisor.down is None \
                and not self.supervisor.closed:
            await self.abort(state.request_id)

    def set_deadline(self, state: RequestState, name: str, at: float, message: str) -> None:
        """At loop time `at` the request fails with RequestTimedOut(message) (a deadline of that name is
        replaced)."""
        if state.released:
            return
        self.clear_deadline(state, name)

        def expire() -> None:
            self.fail(state, RequestTimedOut(message, before_first_audio=state.num_samples == 0))
        state.deadlines[name] = asyncio.get_running_loop().call_at(at, expire)

    def clear_deadline(self, state: RequestState, name: str) -> None:
        deadline = state.deadlines.pop(name, None)
        if deadline is not None:
            deadline.cancel()

    def fail(self, state: RequestState, error: BaseException) -> None:
        """One request fails: its consumer gets `error` next, both stages drop it."""
        if not self.is_live(state):
            return  # it ended meanwhile
        del self.requests[state.request_id]
        self._cancel_deadlines(state)
        state.queue.put_nowait(error)
        task = asyncio.create_task(self.abort(state.request_id))  # the loop keeps only a weak reference
        self.pending_aborts.add(task)
        task.add_done_callback(self.pending_aborts.discard)

    def fail_all(self, error: BaseException) -> None:
        for state in self.requests.values():
            self._cancel_deadlines(state)
            state.queue.put_nowait(error)
        self.requests.clear()
        for waiter in (*self._embeddings.values(), *self._stats.values(), *self._lora_answers.values()):
            if not waiter.done():
                waiter.set_exception(error)

    async def embed_voice(self, command: EmbedVoice, timeout: float, talker: str = "talker") -> np.ndarray:
        """Stage 0's x-vector of a clip, float32 [enc_dim]: RequestError('ref_audio') when the speaker encoder
        refuses the clip (RequestFailed when the stage failed it), StageDeadError when the pipeline fails meanwhile,
        RequestTimedOut past `timeout` seconds."""
        self.supervisor.check_alive()
        waiter = self._embeddings[command.request_id] = asyncio.get_running_loop().create_future()
        try:
            await self.supervisor.send(talker, self._encoder.encode(command), self.supervisor.epoch)
            return await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            await self.abort(command.request_id)
            raise RequestTimedOut(f"the speaker embedding took over {timeout:g} s", before_first_audio=True) from None
        finally:
            del self._embeddings[command.request_id]

    async def change_lora(self, talker: str, command: LoadLoRA | UnloadLoRA, timeout: float) -> None:
        """Load or unload an adapter in `talker` and wait for its answer: RequestError (bad input, naming
        `lora_name` or `lora_path`) when it refuses, StageDeadError when the pipeline fails meanwhile,
        RequestTimedOut past `timeout` seconds."""
        self.supervisor.check_alive()
        key = (type(command).__name__, command.name)
        if key in self._lora_answers:
            raise RequestError("lora_name", f"adapter '{command.name}' is being changed already")
        waiter = self._lora_answers[key] = asyncio.get_running_loop().create_future()
        try:
            await self.supervisor.send(talker, self._encoder.encode(command), self.supervisor.epoch)
            await asyncio.wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise RequestTimedOut(f"the adapter's change took over {timeout:g} s", before_first_audio=True) from None
        finally:
            del self._lora_answers[key]

    async def stats(self, timeout: float = 10.0) -> dict[str, StageStats]:
        """Ask both stages for their live request ids, step counts and CPU time. A stage answers GetStats by its
        name, not by the asker: concurrent callers share the round trip in flight (each waits up to its timeout)."""
        self.supervisor.check_alive()
        if self._stats_round is None or self._stats_round.done():
            self._stats_round = asyncio.ensure_future(self._ask_stats(timeout))
        return await asyncio.wait_for(asyncio.shield(self._stats_round), timeout)

    async def _ask_stats(self, timeout: float) -> dict[str, StageStats]:
        loop, epoch = asyncio.get_running_loop(), self.supervisor.epoch
        self._stats = {stage: loop.create_future() for stage in self.supervisor.stages}
        try:
            for stage in self._stats:
                await self.supervisor.send(stage, self._encoder.encode(GetStats()), epoch)
            results = await asyncio.wait_for(asyncio.gather(*self._stats.values()), timeout)
            return dict(zip(self._stats, results))
        finally:
            self._stats = {}

    @staticmethod
    def _cancel_deadlines(state: RequestState) -> None:
        for deadline in state.deadlines.values():
            deadline.cancel()

    # --- events from the stages -----------------------------------------------------------------------------
    def _on_event(self, frame: bytes) -> None:
        event = self._decoder.decode(frame)
        if isinstance(event, AudioEvent):
            self._on_audio(event)
        elif isinstance(event, TalkerDone):
            self._on_talker_done(event)
        elif isinstance(event, VoiceEmbedding):
            waiter = self._embeddings.get(event.request_id)
            if waiter is not None and not waiter.done():
                if event.failure is None:
                    waiter.set_result(np.frombuffer(event.embedding, dtype=np.float32))
                else:
                    waiter.set_exception(stage_error(event.failure))
        elif isinstance(event, (LoRALoaded, LoRAUnloaded)):
            waiter = self._lora_answers.get(("LoadLoRA" if isinstance(event, LoRALoaded) else "UnloadLoRA",
                                             event.name))
            if waiter is not None and not waiter.done():
                if event.failure is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(stage_error(event.failure))
        elif isinstance(event, Heartbeat):
            self.supervisor.on_heartbeat(event)
        elif isinstance(event, StageStats):
            waiter = self._stats.get(event.stage)
            if waiter is not None and not waiter.done():
                waiter.set_result(event)
        elif isinstance(event, Ready):
            self.supervisor.on_ready(event.stage, event.pid)
        elif isinstance(event, StageFailed):
            self.supervisor.on_stage_failed(event.stage, event.message, event.error)

    def _on_audio(self, event: AudioEvent) -> None:
        state = self.requests.get(event.request_id)
        if state is None:
            return  # aborted meanwhile
        if event.failure is not None:
            self.fail(state, stage_error(event.failure))
            return
        audio = np.frombuffer(event.pcm, dtype=np.float32)
        state.num_samples += audio.shape[0]
        if audio.shape[0] or event.finished:
            self.clear_deadline(state, "first_audio")
        if audio.shape[0]:
            state.buffered_samples += audio.shape[0]
            if state.buffered_samples > self.max_buffered_samples:  # the consumer stalls: free its memory now
                self.fail(state, RequestFailed(
                    f"the client read the audio too slowly (over {self.max_buffered_samples / SAMPLE_RATE:.0f} s "
                    "of audio waiting)"))
                return
            state.queue.put_nowait(SpeechChunk(audio))
        state.audio_done = event.finished
        if state.talker_done is not None:
            self._expect_last_audio(state)
        self._maybe_finish(state)

    def _on_talker_done(self, event: TalkerDone) -> None:
        state = self.requests.get(event.request_id)
        if state is None:
            return
        if event.failure is not None:
            self.fail(state, stage_error(event.failure))
            return
        state.talker_done = event
        self._expect_last_audio(state)
        self._maybe_finish(state)

    def _expect_last_audio(self, state: RequestState) -> None:
        """Stage 0 made every frame: stage 1's audio must keep coming, or a chunk was lost on the way and the last
        audio would never come (the request would wait for its whole `timeout`)."""
        self.set_deadline(state, "last_audio", asyncio.get_running_loop().time() + self.last_audio_timeout,
                          f"no audio for {self.last_audio_timeout:g} s after its last frame was made (a lost chunk)")

    def _maybe_finish(self, state: RequestState) -> None:
        done = state.talker_done
        if done is None or not state.audio_done:
            return
        usage = Usage(input_tokens=state.input_tokens, prompt_rows=done.num_prompt_rows,
                      reference_frames=done.num_reference_frames, output_frames=done.num_frames,
                      audio_seconds=state.num_samples / SAMPLE_RATE, finish_reason=done.finish_reason)
        codes = None
        if done.codes is not None:
            codes = np.frombuffer(done.codes, dtype=np.int32).reshape(done.num_frames, self.num_code_groups)
        self._cancel_deadlines(state)
        state.queue.put_nowait(SpeechChunk(np.zeros(0, np.float32), usage, codes))
