"""Stage 0 process: control messages → talker engine steps → frame chunks into the shared-memory ring.

Base voice features are computed beside the loop (voice_features.py); the loop alone touches the engine."""
from __future__ import annotations

import os
import threading
import time

import numpy as np
import torch

from omni_tts.connectors.shm_ring import ChunkWriter
from omni_tts.engine.chunker import FrameChunker
from omni_tts.engine.talker_engine import TalkerEngine, TalkerRequest
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import TalkerPrompt, embed_prompt

from .common import StageIO, run_stage
from .protocol import (STEP_SECONDS_BUCKETS, Abort, AddRequest, DurationHistogram, GetStats, Ready, Shutdown,
                       StageLaunch, StageStats, TalkerDone)
from .voice_features import FeatureJob, VoiceFeatureCache, VoiceFeatureWorker


class TalkerStage:
    def __init__(self, launch: StageLaunch) -> None:
        self.launch = launch
        self.tts = Qwen3TTS(launch.model_dir, device=launch.device, dtype=getattr(torch, launch.dtype),
                            with_decoder=False)
        self.engine = TalkerEngine(self.tts.talker, self.tts.config, launch.max_batch_size, launch.max_model_len,
                                   launch.max_prefill_tokens_per_step, launch.max_text_tokens,
                                   cuda_graphs=not launch.enforce_eager)
        self.condition = threading.Condition()
        self.io = StageIO(launch, self.condition)
        self.writer = ChunkWriter(launch.ring, on_error=lambda e: self.io.thread_failed("connector", e))
        self.voice_cache = VoiceFeatureCache()
        self.voice_features = VoiceFeatureWorker(self.tts, self.condition, self.voice_cache)
        self.chunkers: dict[str, FrameChunker] = {}
        self.seq: dict[str, int] = {}
        self.prompt_rows: dict[str, int] = {}
        self.num_frames: dict[str, int] = {}
        self.step_durations = DurationHistogram.empty(STEP_SECONDS_BUCKETS)

    def run(self) -> None:
        self.writer.start()
        self.io.send(Ready("talker", os.getpid()))
        while True:
            self.io.wait(lambda: self.voice_features.has_finished() or self.engine.has_work())
            for message in self.io.take_commands():
                if isinstance(message, Shutdown):
                    self.voice_features.close()
                    self.writer.close()
                    self.io.close()
                    return
                self._handle(message)
            for job in self.voice_features.take_finished():
                if job.error is not None:
                    self.io.send(TalkerDone(job.request.request_id, 0, "error", error=job.error))
                else:
                    job.features.apply(job.prompt)
                    self._add(job.request, job.prompt)
            if self.engine.has_work():
                started = time.perf_counter()
                outputs = self.engine.step()
                self.step_durations.observe(time.perf_counter() - started)
                for out in outputs:
                    self._emit(out.request_id, out.frame, out.finished, out.finish_reason)

    def _handle(self, message: object) -> None:
        if isinstance(message, AddRequest):
            self._on_add_request(message)
        elif isinstance(message, Abort):
            self.voice_features.cancel(message.request_id)
            self.engine.abort(message.request_id)
            self._forget(message.request_id)
        elif isinstance(message, GetStats):
            stats = self.engine.stats()
            self.io.send(StageStats("talker", os.getpid(), stats.request_ids, stats.steps, time.process_time(),
                                    self.step_durations))

    def _on_add_request(self, m: AddRequest) -> None:
        """Base requests need voice features: from the cache, else from the worker (admitted when they are ready)."""
        prompt = TalkerPrompt(role_ids=m.role_ids, text_ids=m.text_ids, instruct_ids=m.instruct_ids,
                              language_id=m.language_id, speaker_id=m.speaker_id, non_streaming=m.non_streaming,
                              ref_text_ids=m.ref_text_ids)
        if m.ref_audio is not None:
            cached = self.voice_cache.get(m.voice_key, icl=prompt.ref_text_ids is not None)
            if cached is None:
                self.voice_features.submit(FeatureJob(m, prompt))
                return
            cached.apply(prompt)
        self._add(m, prompt)

    def _add(self, m: AddRequest, prompt: TalkerPrompt) -> None:
        try:
            self._admit(m, prompt)
        except Exception as e:  # a bad request fails alone, the stage keeps serving
            self.io.send(TalkerDone(m.request_id, 0, "error", error=f"{type(e).__name__}: {e}"))

    @torch.inference_mode()
    def _admit(self, m: AddRequest, prompt: TalkerPrompt) -> None:
        """Embed the prompt (voice features filled in), queue it in the engine, and put any ICL context chunk
        into the ring: before the request's first frame, which only a later step makes."""
        prefill, trailing = embed_prompt(self.tts.talker, self.tts.config, prompt)
        self.engine.add_request(TalkerRequest(m.request_id, prefill, trailing, m.sampling, m.max_tokens))
        initial = m.initial_chunk_frames or self.launch.initial_chunk_frames
        self.chunkers[m.request_id] = FrameChunker(min(initial, self.launch.ring.max_frames), self.launch.chunk_frames)
        self.seq[m.request_id] = 0
        self.prompt_rows[m.request_id] = prefill.shape[0]
        self.num_frames[m.request_id] = 0
        if prompt.ref_codes is not None:  # ICL: the reference codes are the decoder's left context
            codes = prompt.ref_codes.cpu().numpy()
            for start in range(0, codes.shape[0], self.launch.ring.max_frames):
                self._put(m.request_id, codes[start:start + self.launch.ring.max_frames], False, True)

    def _put(self, request_id: str, codes: np.ndarray, is_last: bool, is_context: bool = False) -> None:
        self.writer.put(request_id, self.seq[request_id], codes, is_last, is_context)
        self.seq[request_id] += 1

    def _emit(self, request_id: str, frame: np.ndarray | None, finished: bool, reason: str | None) -> None:
        chunk = self.chunkers[request_id].add(frame, finished)
        if chunk is not None:
            self._put(request_id, chunk, finished)
        if frame is not None:
            self.num_frames[request_id] += 1
        if finished:
            self.io.send(TalkerDone(request_id, self.num_frames[request_id], reason, self.prompt_rows[request_id]))
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self.chunkers.pop(request_id, None)
        self.seq.pop(request_id, None)
        self.prompt_rows.pop(request_id, None)
        self.num_frames.pop(request_id, None)


def main(launch_bytes: bytes) -> None:
    run_stage(launch_bytes, lambda launch: TalkerStage(launch).run())
