"""Stage 1: codec frames → audio with the exact stateful streaming decoder, batched across requests.

Each registered request owns a `DecoderStreamState`; its chunks queue in order. A step takes the oldest pending
chunk of up to `max_batch_size` requests, groups them by chunk length (one batched decoder call per group, rows at
different stream offsets), and returns only each chunk's new samples. Context chunks (the ICL reference codes)
prime the state and emit nothing. A request's state is freed at its last chunk or on abort.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import torch

from omni_tts.models.qwen3_tts.speech_decoder import DecoderStreamState, SpeechDecoder


@dataclass
class CodecChunk:
    codes: np.ndarray          # [F, 16] int
    is_last: bool = False
    is_context: bool = False   # decoder left context (ICL reference codes): decoded, not emitted


@dataclass
class AudioOutput:
    request_id: str
    audio: np.ndarray          # float32 [F * samples_per_frame] at 24 kHz (empty for a bare end marker)
    finished: bool


class Code2WavEngine:
    def __init__(self, decoder: SpeechDecoder, max_batch_size: int) -> None:
        self.decoder = decoder
        self.device = decoder.pre_conv.conv.weight.device
        self.max_batch_size = max_batch_size
        self.states: dict[str, DecoderStreamState] = {}
        self.pending: dict[str, deque[CodecChunk]] = {}
        self.num_steps = 0

    def add_request(self, request_id: str) -> None:
        """Pre-register (allocates the stream state) before the first chunk arrives."""
        if request_id not in self.states:
            self.states[request_id] = self.decoder.new_stream_state(1)
            self.pending[request_id] = deque()

    def add_chunk(self, request_id: str, chunk: CodecChunk) -> bool:
        """Queue a chunk; False if the request is unknown (aborted or never registered): the chunk is dropped."""
        queue = self.pending.get(request_id)
        if queue is None:
            return False
        queue.append(chunk)
        return True

    def abort(self, request_id: str) -> bool:
        self.pending.pop(request_id, None)
        return self.states.pop(request_id, None) is not None

    def has_work(self) -> bool:
        return any(self.pending.values())

    @property
    def num_requests(self) -> int:
        return len(self.states)

    @torch.inference_mode()
    def step(self) -> list[AudioOutput]:
        ready = [rid for rid, queue in self.pending.items() if queue][: self.max_batch_size]
        groups: dict[int, list[tuple[str, CodecChunk]]] = {}
        for rid in ready:
            chunk = self.pending[rid].popleft()
            groups.setdefault(chunk.codes.shape[0], []).append((rid, chunk))
        outputs = []
        for frames, members in groups.items():
            if frames == 0:
                audio = np.zeros((len(members), 0), dtype=np.float32)
            else:
                codes = torch.from_numpy(np.stack([c.codes for _, c in members]).astype(np.int64))
                codes = codes.transpose(1, 2).to(self.device)                       # [B, 16, F]
                state = DecoderStreamState.stack([self.states[rid] for rid, _ in members])
                audio = self.decoder.decode_chunk(codes, state).float().cpu().numpy()
                for (rid, _), row_state in zip(members, state.unbind()):
                    self.states[rid] = row_state
            for row, (rid, chunk) in enumerate(members):
                if chunk.is_last:
                    self.abort(rid)  # frees the state
                if chunk.is_context and not chunk.is_last:
                    continue
                outputs.append(AudioOutput(rid, np.zeros(0, np.float32) if chunk.is_context else audio[row],
                                           chunk.is_last))
        self.num_steps += 1
        return outputs
