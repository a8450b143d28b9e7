"""Stage 0 process: control messages → talker engine steps → frame chunks into the connector (shm ring / TCP).

Base voice features are computed beside the loop (voice_features.py); the loop alone touches the engine. A request
whose text is still arriving (AddRequest.text_open) enters the engine once its prefill's text is here (the first
text token; for ICL as many as the reference has frames), and the AppendText that follow extend its trailing text.
LoRA adapters: the launch's are read and loaded before Ready (a bad one fails the start, naming its file); a
LoadLoRA is read beside the loop (lora_reads.py) and loaded between two steps.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from omni_tts.connectors.base import ChunkWriterBase
from omni_tts.connectors.kinds import chunk_writer
from omni_tts.engine.chunker import FrameChunker
from omni_tts.engine.talker_engine import TalkerEngine, TalkerRequest
from omni_tts.engine.talker_input import give_voice
from omni_tts.models.qwen3_tts.lora import read_adapter
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import (PromptLimits, RequestError, check_speaker_embedding, embed_prompt,
                                              embed_text)
from omni_tts.models.qwen3_tts.talker import import_fused_kernels

from .common import StageIO, run_stage
from .lora_reads import LoRARead, LoRAReader
from .messages import (STEP_SECONDS_BUCKETS, Abort, AddRequest, AppendText, DurationHistogram, EmbedVoice,
                       FailureKind, GetStats, LoadLoRA, LoRALoaded, LoRAUnloaded, Ready, RequestFailure, Shutdown,
                       StageLaunch, StageStats, TalkerDone, UnloadLoRA, VoiceEmbedding)
from .voice_features import FeatureJob, VoiceFeatureCache, VoiceFeatures, VoiceFeatureWorker

logger = logging.getLogger(__name__)


@dataclass
class TalkerStageRequest:
    """One request in this stage, from its AddRequest to its TalkerDone (or abort)."""
    add: AddRequest                          # its prompt gets the voice features (at once but for Base)
    max_tokens: int                          # the token limit for the text so far
    text_done: bool
    has_features: bool = False
    pending_ids: list[int] = field(default_factory=list)   # text that came before it could enter the engine
    chunker: FrameChunker | None = None      # from its admission into the engine on
    seq: int = 0                             # its next connector chunk
    num_prompt_rows: int = 0
    num_reference_frames: int = 0
    num_frames: int = 0
    frames: list[np.ndarray] | None = None   # AddRequest.return_codes: every generated frame, for its TalkerDone

    @property
    def in_engine(self) -> bool:
        return self.chunker is not None


class TalkerStage:
    def __init__(self, launch: StageLaunch, writer: ChunkWriterBase | None = None) -> None:
        """writer: the connector's talker end when the process made it (the fused layout's in-process one)."""
        self.launch = launch
        cfg = launch.config
        self.tts = Qwen3TTS(launch.model_dir, device=cfg.device, dtype=getattr(torch, cfg.dtype), with_decoder=False)
        if cfg.fused_kernels and self.tts.device.type == "cuda":
            self.tts.talker.use_fused_kernels(import_fused_kernels(self.tts.dtype))
        try:
            self.engine = self._new_engine()
        except Exception:   # a Triton kernel this device cannot compile fails the capture: serve, on the plain ops
            if self.tts.talker.kernels is None:
                raise
            logger.exception("talker: the fused kernels failed on %s; the plain ops run (stages.talker.fused_kernels:"
                             " false says so up front)", cfg.device)
            self.tts.talker.use_fused_kernels(None)
            self.engine = self._new_engine()
        for name, path in launch.loras.items():
            self.engine.load_lora(name, read_adapter(path, self.tts.config.talker, cfg.max_lora_rank))
        self.limits = PromptLimits(cfg.max_text_tokens, cfg.max_model_len)
        self.condition = threading.Condition()
        self.io = StageIO(launch, self.condition)
        self.writer = writer or chunk_writer(launch.connector,
                                             on_error=lambda e: self.io.thread_failed("connector", e))
        self.io.clock.writer = self.writer   # its stalls go out with the heartbeats
        self.voice_cache = VoiceFeatureCache()
        self.voice_features = VoiceFeatureWorker(self.tts, self.condition, self.voice_cache)
        self.lora_reads = LoRAReader(self.tts.config.talker, cfg.max_lora_rank, self.condition)
        self.requests: dict[str, TalkerStageRequest] = {}
        self.step_durations = DurationHistogram.empty(STEP_SECONDS_BUCKETS)

    def _new_engine(self) -> TalkerEngine:
        cfg = self.launch.config
        return TalkerEngine(self.tts.talker, self.tts.config, self.launch.max_batch_size, cfg.max_model_len,
                            cfg.max_prefill_tokens_per_step, cfg.max_text_tokens, cuda_graphs=not cfg.enforce_eager,
                            max_loras=cfg.max_loras, max_lora_rank=cfg.max_lora_rank)

    def run(self) -> None:
        self.writer.start()
        self.io.send(Ready(self.launch.stage, os.getpid()))
        while True:
            self.io.wait(lambda: self.voice_features.has_finished() or self.lora_reads.has_finished()
                         or self.engine.has_work())
            for message in self.io.take_commands():
                if isinstance(message, Shutdown):
                    self.voice_features.close()
                    self.lora_reads.close()
                    if message.release_wait:
                        self.writer.wait_released(message.release_wait)
                    self.writer.close()
                    self.io.close()
                    return
                self._handle(message)
            for read in self.lora_reads.take_finished():
                self._load_lora(read)
            for job in self.voice_features.take_finished():
                if isinstance(job.request, EmbedVoice):
                    self._answer_embedding(job.request.request_id, job.features, job.failure)
                    continue
                request = self.requests[job.request.request_id]  # an aborted job is never handed back
                if job.failure is not None:
                    self._fail(request, job.failure)
                else:
                    job.features.apply(request.add.prompt)
                    self._on_features(request)
            if self.engine.has_work():
                started = time.perf_counter()
                outputs = self.engine.step()
                self.step_durations.observe(time.perf_counter() - started)
                for out in outputs:
                    self._emit(self.requests[out.request_id], out.frame, out.finished, out.finish_reason)
                # a request that caught up with its text sends what it has: the player must not run dry on audio
                # that is made already (the cost: smaller chunks while the text is slower than the talker)
                for request_id in self.engine.waiting_for_text():
                    request = self.requests[request_id]
                    chunk = request.chunker.flush()
                    if chunk is not None:
                        self._put(request, chunk, False)

    def _handle(self, message: object) -> None:
        if isinstance(message, AddRequest):
            self._on_add_request(message)
        elif isinstance(message, AppendText):
            self._on_append_text(message)
        elif isinstance(message, EmbedVoice):
            cached = self.voice_cache.get(message.voice_version, icl=False)
            if cached is None:
                self.voice_features.submit(FeatureJob(message))
            else:
                self._answer_embedding(message.request_id, cached, None)
        elif isinstance(message, LoadLoRA):
            self.lora_reads.submit(message)
        elif isinstance(message, UnloadLoRA):
            try:
                self.engine.unload_lora(message.name)
                self.io.send(LoRAUnloaded(message.name))
            except ValueError as e:
                self.io.send(LoRAUnloaded(message.name, RequestFailure(FailureKind.BAD_INPUT, str(e), "lora_name")))
        elif isinstance(message, Abort):
            self.voice_features.cancel(message.request_id)
            self.engine.abort(message.request_id)
            self.requests.pop(message.request_id, None)
        elif isinstance(message, GetStats):
            stats, connector = self.engine.stats(), self.writer.stats()
            self.io.send(StageStats(
                self.launch.stage, os.getpid(), stats.request_ids, self.engine.num_steps, time.process_time(),
                self.step_durations,
                prompts_waiting_for_text=sum(r.add.text_open and not r.in_engine for r in self.requests.values()),
                rows_waiting_for_text=stats.num_parked, connector_waiting=connector.pending,
                connector_slots_in_use=connector.slots_in_use, connector_slot_stalls=connector.slot_stalls,
                deferred_admissions=stats.num_deferred_admissions))

    def _load_lora(self, read: LoRARead) -> None:
        """A read adapter into a free slot, between two steps (running rows keep theirs); answered by LoRALoaded."""
        failure = read.failure
        if read.adapter is not None:
            try:
                self.engine.load_lora(read.command.name, read.adapter)
            except ValueError as e:
                failure = RequestFailure(FailureKind.BAD_INPUT, str(e), "lora_name")
        self.io.send(LoRALoaded(read.command.name, failure))

    def _on_add_request(self, m: AddRequest) -> None:
        """Base requests need voice features: from the cache, else from the worker (admitted when they are ready)."""
        request = self.requests[m.request_id] = TalkerStageRequest(m, m.max_tokens, text_done=not m.text_open,
                                                                   frames=[] if m.return_codes else None)
        if m.lora is not None:
            try:  # before any voice-feature work; checked again at admission (it may be unloaded meanwhile)
                self.engine.check_lora(m.lora)
            except RequestError as e:
                self._fail(request, RequestFailure.of(e))
                return
        ref_codes = (None if m.ref_codes is None else  # given ICL reference codes: a clip gives the x-vector alone
                     np.frombuffer(m.ref_codes, dtype=np.int32).reshape(-1, self.tts.config.talker.num_code_groups))
        embedding = None
        if m.speaker_embedding is not None:
            try:  # checked before it was sent; a vector of another size would fail deep in the prefill's concat
                embedding = check_speaker_embedding(self.tts.config, np.frombuffer(m.speaker_embedding, np.float32),
                                                    ref_audio=False, ref_text=False)
            except ValueError as e:
                self._fail(request, RequestFailure.of(e))
                return
        if not give_voice(m.prompt, ref_codes, embedding) and m.ref_audio is not None:
            cached = self.voice_cache.get(m.voice_version, icl=m.prompt.wants_clip_codes)
            if cached is None:
                self.voice_features.submit(FeatureJob(m))
                return
            cached.apply(m.prompt)
        self._on_features(request)

    def _answer_embedding(self, request_id: str, features: VoiceFeatures | None,
                          failure: RequestFailure | None) -> None:
        """An EmbedVoice's x-vector, exactly as a request's prompt would hold it, as float32 bytes."""
        if features is None:
            self.io.send(VoiceEmbedding(request_id, failure=failure))
            return
        vector = features.speaker_embedding.detach().to("cpu", torch.float32)
        self.io.send(VoiceEmbedding(request_id, vector.numpy().tobytes()))

    def _on_features(self, request: TalkerStageRequest) -> None:
        """A request with its voice features: into the engine, or (open text) once its prefill's text is here."""
        request.has_features = True
        try:
            self._admit_if_ready(request)
        except Exception as e:  # a bad request fails alone, the stage keeps serving
            self._fail(request, RequestFailure.of(e))

    def _on_append_text(self, m: AppendText) -> None:
        request = self.requests.get(m.request_id)
        if request is None or request.text_done:
            return  # ended meanwhile (its end token, an abort, an error): the rest of its text has no use
        request.max_tokens, request.text_done = m.max_tokens, m.done
        try:
            if request.in_engine:
                rows = embed_text(self.tts.talker, self.tts.config, m.text_ids, m.done)
                self.engine.append_text(m.request_id, rows, m.max_tokens, m.done)
            else:
                request.pending_ids += m.text_ids
                if request.has_features:
                    self._admit_if_ready(request)
        except Exception as e:
            self._fail(request, RequestFailure.of(e))

    def _admit_if_ready(self, request: TalkerStageRequest) -> None:
        prompt = request.add.prompt
        prompt.text_ids += request.pending_ids
        request.pending_ids = []
        if request.text_done or len(prompt.text_ids) >= prompt.prefill_text_tokens:
            self._admit(request)

    def _fail(self, request: TalkerStageRequest, failure: RequestFailure) -> None:
        self.voice_features.cancel(request.add.request_id)
        self.engine.abort(request.add.request_id)
        self.requests.pop(request.add.request_id, None)
        self.io.send(TalkerDone(request.add.request_id, 0, "error", failure=failure))

    @torch.inference_mode()
    def _admit(self, request: TalkerStageRequest) -> None:
        """Embed the prompt (voice features filled in), queue it in the engine, and put any ICL context chunk
        into the connector: before the request's first frame, which only a later step makes."""
        m, prompt = request.add, request.add.prompt
        if prompt.is_icl and m.ref_codes is None:  # the clip's reference frames are known only now
            self.limits.check_fits(prompt, prompt.ref_codes.shape[0], "ref_audio")
        prefill, trailing = embed_prompt(self.tts.talker, self.tts.config, prompt, request.text_done)
        # its chunk schedule by the load it finds (chunk_schedule auto); its own first chunk was checked to fit a slot
        chunk_frames = self.launch.pipeline.connector.chunk_frames(m.initial_codec_chunk_frames,
                                                                   self.engine.scheduler.num_requests)
        self.engine.add_request(TalkerRequest(m.request_id, prefill, trailing, m.sampling, request.max_tokens,
                                              request.text_done, lora=m.lora))
        request.chunker = FrameChunker(chunk_frames)
        max_frames = self.launch.connector.max_frames
        request.num_prompt_rows = prefill.shape[0]
        if prompt.ref_codes is not None:  # ICL: the reference codes are the decoder's left context
            codes = prompt.ref_codes.cpu().numpy()
            request.num_reference_frames = codes.shape[0]
            for start in range(0, codes.shape[0], max_frames):
                self._put(request, codes[start:start + max_frames], False, True)

    def _put(self, request: TalkerStageRequest, codes: np.ndarray, is_last: bool, is_context: bool = False) -> None:
        self.writer.put(request.add.request_id, request.seq, codes, is_last, is_context)
        request.seq += 1

    def _emit(self, request: TalkerStageRequest, frame: np.ndarray | None, finished: bool,
              reason: str | None) -> None:
        chunk = request.chunker.add(frame, finished)
        if chunk is not None:
            self._put(request, chunk, finished)
        if frame is not None:
            request.num_frames += 1
            if request.frames is not None:
                request.frames.append(frame)
        if finished:
            request_id = request.add.request_id
            codes = None if request.frames is None else np.array(request.frames, dtype=np.int32).tobytes()
            self.io.send(TalkerDone(request_id, request.num_frames, reason, request.num_prompt_rows,
                                    request.num_reference_frames, codes=codes))
            del self.requests[request_id]


def main(launch_bytes: bytes) -> None:
    run_stage(launch_bytes, lambda launch: TalkerStage(launch).run())
