"""Stage 0 process: control messages → talker engine steps → frame chunks into the connector (shm ring / TCP).

Base voice features are computed beside the loop (voice_features.py); the loop alone touches the engine. A request
whose text is still arriving (AddRequest.text_open) enters the engine once its prefill's text is here (the first
text token; for ICL as many as the reference has frames), and the AppendText that follow extend its trailing text.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from omni_tts.connectors.kinds import chunk_writer
from omni_tts.engine.chunker import FrameChunker
from omni_tts.engine.talker_engine import TalkerEngine, TalkerRequest
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import TalkerPrompt, embed_prompt, embed_text

from .common import StageIO, run_stage
from .protocol import (STEP_SECONDS_BUCKETS, Abort, AddRequest, AppendText, DurationHistogram, GetStats, Ready,
                       Shutdown, StageLaunch, StageStats, TalkerDone)
from .voice_features import FeatureJob, VoiceFeatureCache, VoiceFeatureWorker


@dataclass
class OpenText:
    """A request added with open text, from its AddRequest to its last AppendText."""
    request: AddRequest
    max_tokens: int                          # the token limit for the text so far
    done: bool = False
    prompt: TalkerPrompt | None = None       # once its voice features are in (at once but for Base)
    pending_ids: list[int] = field(default_factory=list)   # arrived before the request could enter the engine
    in_engine: bool = False


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
        self.writer = chunk_writer(launch.connector, on_error=lambda e: self.io.thread_failed("connector", e))
        self.voice_cache = VoiceFeatureCache()
        self.voice_features = VoiceFeatureWorker(self.tts, self.condition, self.voice_cache)
        self.chunkers: dict[str, FrameChunker] = {}
        self.seq: dict[str, int] = {}
        self.prompt_rows: dict[str, int] = {}
        self.num_frames: dict[str, int] = {}
        self.open_texts: dict[str, OpenText] = {}
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
                    self._fail(job.request.request_id, job.error)
                else:
                    job.features.apply(job.prompt)
                    self._add(job.request, job.prompt)
            if self.engine.has_work():
                started = time.perf_counter()
                outputs = self.engine.step()
                self.step_durations.observe(time.perf_counter() - started)
                for out in outputs:
                    self._emit(out.request_id, out.frame, out.finished, out.finish_reason)
                # a request that caught up with its text sends what it has: the player must not run dry on audio
                # that is made already (the cost: smaller chunks while the text is slower than the talker)
                for request_id in self.engine.waiting_for_text():
                    chunk = self.chunkers[request_id].flush()
                    if chunk is not None:
                        self._put(request_id, chunk, False)

    def _handle(self, message: object) -> None:
        if isinstance(message, AddRequest):
            self._on_add_request(message)
        elif isinstance(message, AppendText):
            self._on_append_text(message)
        elif isinstance(message, Abort):
            self.voice_features.cancel(message.request_id)
            self.engine.abort(message.request_id)
            self._forget(message.request_id)
        elif isinstance(message, GetStats):
            stats = self.engine.stats()
            self.io.send(StageStats(
                "talker", os.getpid(), stats.request_ids, self.engine.num_steps, time.process_time(), self.step_durations,
                prompts_waiting_for_text=sum(not t.in_engine for t in self.open_texts.values()),
                rows_waiting_for_text=stats.num_parked))

    def _on_add_request(self, m: AddRequest) -> None:
        """Base requests need voice features: from the cache, else from the worker (admitted when they are ready)."""
        prompt = TalkerPrompt(role_ids=m.role_ids, text_ids=m.text_ids, instruct_ids=m.instruct_ids,
                              language_id=m.language_id, speaker_id=m.speaker_id, non_streaming=m.non_streaming,
                              ref_text_ids=m.ref_text_ids)
        if m.text_open:
            self.open_texts[m.request_id] = OpenText(m, m.max_tokens)
        if m.ref_audio is not None:
            cached = self.voice_cache.get(m.voice_key, icl=prompt.ref_text_ids is not None)
            if cached is None:
                self.voice_features.submit(FeatureJob(m, prompt))
                return
            cached.apply(prompt)
        self._add(m, prompt)

    def _add(self, m: AddRequest, prompt: TalkerPrompt) -> None:
        """A request with its voice features: into the engine, or (open text) once its prefill's text is here."""
        try:
            open_text = self.open_texts.get(m.request_id)
            if open_text is None:
                self._admit(m, prompt, m.max_tokens, text_done=True)
            else:
                open_text.prompt = prompt
                self._start_open_text(open_text)
        except Exception as e:  # a bad request fails alone, the stage keeps serving
            self._fail(m.request_id, f"{type(e).__name__}: {e}")

    def _on_append_text(self, m: AppendText) -> None:
        open_text = self.open_texts.get(m.request_id)
        if open_text is None:
            return  # ended meanwhile (its end token, an abort, an error): the rest of its text has no use
        open_text.max_tokens, open_text.done = m.max_tokens, m.done
        try:
            if open_text.in_engine:
                rows = embed_text(self.tts.talker, self.tts.config, m.text_ids, m.done)
                self.engine.append_text(m.request_id, rows, m.max_tokens, m.done)
                if m.done:
                    del self.open_texts[m.request_id]
            else:
                open_text.pending_ids += m.text_ids
                if open_text.prompt is not None:
                    self._start_open_text(open_text)
        except Exception as e:
            self._fail(m.request_id, f"{type(e).__name__}: {e}")

    def _start_open_text(self, open_text: OpenText) -> None:
        prompt = open_text.prompt
        prompt.text_ids += open_text.pending_ids
        open_text.pending_ids = []
        if open_text.done or len(prompt.text_ids) >= prompt.prefill_text_tokens:
            self._admit(open_text.request, prompt, open_text.max_tokens, open_text.done)
            open_text.in_engine = True
            if open_text.done:
                del self.open_texts[open_text.request.request_id]

    def _fail(self, request_id: str, error: str) -> None:
        self.engine.abort(request_id)
        self._forget(request_id)
        self.io.send(TalkerDone(request_id, 0, "error", error=error))

    @torch.inference_mode()
    def _admit(self, m: AddRequest, prompt: TalkerPrompt, max_tokens: int, text_done: bool) -> None:
        """Embed the prompt (voice features filled in), queue it in the engine, and put any ICL context chunk
        into the connector: before the request's first frame, which only a later step makes."""
        prefill, trailing = embed_prompt(self.tts.talker, self.tts.config, prompt, text_done)
        self.engine.add_request(TalkerRequest(m.request_id, prefill, trailing, m.sampling, max_tokens, text_done))
        initial = m.initial_chunk_frames or self.launch.initial_chunk_frames
        max_frames = self.launch.connector.max_frames
        self.chunkers[m.request_id] = FrameChunker(min(initial, max_frames), self.launch.chunk_frames)
        self.seq[m.request_id] = 0
        self.prompt_rows[m.request_id] = prefill.shape[0]
        self.num_frames[m.request_id] = 0
        if prompt.ref_codes is not None:  # ICL: the reference codes are the decoder's left context
            codes = prompt.ref_codes.cpu().numpy()
            for start in range(0, codes.shape[0], max_frames):
                self._put(m.request_id, codes[start:start + max_frames], False, True)

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
        self.open_texts.pop(request_id, None)


def main(launch_bytes: bytes) -> None:
    run_stage(launch_bytes, lambda launch: TalkerStage(launch).run())
