"""Base (voice clone) features off the talker's step loop: a worker thread, and an LRU cache per uploaded voice.

The speaker encoder (x-vector) and, for ICL, the Mimi encoder (reference codes) take tens to hundreds of ms for
a 10 s clip; run inside the step loop, that pause would hit every running stream. The worker computes them on its
own thread (on CUDA: its own stream) and hands each finished job back to the loop, which alone touches the engine.

Batching: the worker takes every queued job at once. Jobs with identical clips are computed once; distinct clips
run one after another, because neither encoder gives the same result batched: padding changes the x-vector's
attentive pooling over time and Mimi's replicate-padded downsample, and even identical-length clips are not bitwise
equal in a batch on CPU (a Res2Net conv of the speaker encoder differs by ~1e-6 between batch 1 and batch 4).

Caching: features are cached under the request's `voice_version` (an uploaded voice's version, which never changes
content). Inline ref_audio is not cached: a one-off clip would push saved voices out of the LRU, and a hit or miss
on a content hash would tell one client, by latency, whether another recently used that clip; a client that
reuses a clip should upload it.
"""
from __future__ import annotations

import collections
import os
import sys
import threading
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import TalkerPrompt

from .messages import AddRequest, EmbedVoice, RequestFailure

WORKER_NICENESS = 5  # CPU: on top of the stage's; streams keep their pace, admission waits when cores are short
MAX_CACHED_VOICES = 256


@dataclass(frozen=True)
class VoiceFeatures:
    speaker_embedding: torch.Tensor      # x-vector [enc_dim] on the talker's device
    ref_codes: torch.Tensor | None       # ICL reference codes [T_ref, 16] int64 on CPU; None if never needed yet

    def covers(self, icl: bool) -> bool:
        return not icl or self.ref_codes is not None

    def apply(self, prompt: TalkerPrompt) -> None:
        """Fill the prompt's voice features (the clip's reference codes only for ICL without given ones: they make
        the prompt an ICL one). Called on the loop's thread."""
        if self.speaker_embedding.is_cuda:
            # made on the worker's stream, read on the loop's: keep the memory until the loop's use is done
            self.speaker_embedding.record_stream(torch.cuda.current_stream(self.speaker_embedding.device))
        prompt.speaker_embedding = self.speaker_embedding
        if prompt.wants_clip_codes:
            prompt.ref_codes = self.ref_codes


@dataclass
class FeatureJob:
    request: AddRequest | EmbedVoice     # a request's prompt is the loop's (the worker only reads whether it is
                                         # ICL); an EmbedVoice wants the x-vector alone
    features: VoiceFeatures | None = None   # set by the worker, or
    failure: RequestFailure | None = None   # why the clip gave none (bad input: a clip the encoders refuse)

    @property
    def icl(self) -> bool:
        """It needs the clip's reference codes too."""
        return isinstance(self.request, AddRequest) and self.request.prompt.wants_clip_codes


class VoiceFeatureCache:
    """Features by voice key, least recently used first out, at most `max_entries`; thread-safe."""

    def __init__(self, max_entries: int = MAX_CACHED_VOICES) -> None:
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._entries: collections.OrderedDict[str, VoiceFeatures] = collections.OrderedDict()

    def get(self, key: str | None, icl: bool) -> VoiceFeatures | None:
        """The cached features if they serve this request (an x-vector-only entry does not serve ICL)."""
        if key is None:
            return None
        with self._lock:
            features = self._entries.get(key)
            if features is None or not features.covers(icl):
                return None
            self._entries.move_to_end(key)
            return features

    def put(self, key: str, features: VoiceFeatures) -> None:
        with self._lock:
            old = self._entries.get(key)
            if old is None or not old.covers(features.ref_codes is not None):  # never drop cached ICL codes
                self._entries[key] = features
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)


class VoiceFeatureWorker:
    """Owns the feature thread. `submit` (loop) → the thread computes → `take_finished` (loop, after a wake-up
    on `condition`). A `cancel`led job is never handed back. Jobs, results and the wake-up share the loop's lock."""

    def __init__(self, tts: Qwen3TTS, condition: threading.Condition, cache: VoiceFeatureCache) -> None:
        self.tts, self.condition, self.cache = tts, condition, cache
        self.stream = torch.cuda.Stream(tts.device) if tts.device.type == "cuda" else None
        self._queue: list[FeatureJob] = []
        self._live: dict[str, FeatureJob] = {}      # submitted and not yet taken or cancelled
        self._finished: list[FeatureJob] = []
        self._failure: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="omni-tts-talker-voice-features", daemon=True)
        self._thread.start()

    def submit(self, job: FeatureJob) -> None:
        with self.condition:
            self._queue.append(job)
            self._live[job.request.request_id] = job
            self.condition.notify_all()

    def cancel(self, request_id: str) -> None:
        with self.condition:
            job = self._live.pop(request_id, None)
            if job is not None and job in self._finished:
                self._finished.remove(job)

    def has_finished(self) -> bool:
        """Call with `condition` held (the loop's wait predicate)."""
        return bool(self._finished) or self._failure is not None

    def take_finished(self) -> list[FeatureJob]:
        with self.condition:
            if self._failure is not None:
                raise RuntimeError("the voice feature worker died") from self._failure
            jobs, self._finished = self._finished, []
            for job in jobs:
                del self._live[job.request.request_id]
            return jobs

    def close(self) -> None:
        """Stop taking jobs; a batch in progress is abandoned with the process (the thread is a daemon)."""
        with self.condition:
            self._closed = True
            self.condition.notify_all()

    # --- the thread -----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            if self.stream is None and sys.platform == "linux":  # Linux: a thread id names just that thread
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICENESS)
            while True:
                with self.condition:
                    self.condition.wait_for(lambda: self._queue or self._closed)
                    if self._closed:
                        return
                    batch = [job for job in self._queue if self._live.get(job.request.request_id) is job]
                    self._queue.clear()
                self._compute(batch)
                with self.condition:
                    self._finished += [job for job in batch if self._live.get(job.request.request_id) is job]
                    self.condition.notify_all()
        except BaseException as e:  # a bug, not a bad clip: fail the stage rather than hang its requests
            with self.condition:
                self._failure = e
                self.condition.notify_all()

    @torch.inference_mode()
    def _compute(self, batch: list[FeatureJob]) -> None:
        groups: dict[bytes, list[FeatureJob]] = collections.defaultdict(list)  # identical clips are computed once
        for job in batch:
            groups[job.request.ref_audio].append(job)
        for audio, jobs in groups.items():
            try:
                features = self._features(audio, jobs)
            except Exception as e:  # a bad clip fails its requests alone
                for job in jobs:
                    job.failure = RequestFailure.of(e)
                continue
            for job in jobs:
                job.features = features
                if job.request.voice_version is not None:
                    self.cache.put(job.request.voice_version, features)

    def _features(self, audio: bytes, jobs: list[FeatureJob]) -> VoiceFeatures:
        icl = any(job.icl for job in jobs)
        for key in {job.request.voice_version for job in jobs}:  # computed since this job was queued
            cached = self.cache.get(key, icl)
            if cached is not None:
                return cached
        # a copy of the ICL job's prompt, if any, so the model computes the reference codes too
        icl_job = next((job for job in jobs if job.icl), None)
        prompt = (msgspec.structs.replace(icl_job.request.prompt) if icl_job is not None else
                  TalkerPrompt(role_ids=[], text_ids=[], instruct_ids=[], language_id=None, speaker_id=None,
                               non_streaming=False))
        wav = np.frombuffer(audio, dtype=np.float32).copy()
        if self.stream is None:
            self.tts.add_voice_features(prompt, wav)
        else:
            with torch.cuda.stream(self.stream):
                self.tts.add_voice_features(prompt, wav)
            self.stream.synchronize()
        return VoiceFeatures(prompt.speaker_embedding, prompt.ref_codes)
