"""Stage 0: the talker with continuous batching (requests join and leave at every step).

Each running request owns one row of preallocated device buffers: its KV-cache row, last hidden state, pending c0,
trailing-text rows (+ the tts_pad row after them) and sampling state. Rows 0..B-1 are the running requests; when
one finishes, the last row is moved into its place, so every step works on contiguous views and only the step's
[B, 16] frame codes (+ the next c0) leave the device.

A step = admit waiting requests (prefill, within a token budget, so new requests never stall running ones for
long) → one decode step for every running row (code predictor batched over rows, then the talker).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from omni_tts.models.qwen3_tts.config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.layers import KVCache
from omni_tts.models.qwen3_tts.sampling import BatchSampler, ResolvedSampling
from omni_tts.models.qwen3_tts.talker import Talker


@dataclass
class TalkerRequest:
    request_id: str
    prefill: torch.Tensor      # [L, H] on the engine's device
    trailing: torch.Tensor     # [T, H]
    sampling: ResolvedSampling
    max_tokens: int            # sampled-token limit (N tokens give at most N - 1 frames)
    length: int = 0            # cache slots in use
    num_tokens: int = 0        # c0 tokens sampled so far
    num_frames: int = 0


@dataclass
class FrameOutput:
    request_id: str
    frame: np.ndarray | None   # [16] int codes of this step's frame, None when the request ends without one
    finished: bool = False
    finish_reason: str | None = None   # "stop" (EOS) | "length" | "abort"


@dataclass
class TalkerEngineStats:
    num_running: int
    num_waiting: int
    free_rows: int
    steps: int
    request_ids: list[str] = field(default_factory=list)


class TalkerEngine:
    def __init__(self, talker: Talker, config: Qwen3TTSConfig, max_batch_size: int, max_model_len: int,
                 max_prefill_tokens_per_step: int, max_text_tokens: int) -> None:
        tc = config.talker
        self.talker, self.config = talker, config
        self.device, self.dtype = talker.codec_head.weight.device, talker.codec_head.weight.dtype
        self.max_rows, self.max_model_len = max_batch_size, max_model_len
        self.max_prefill_tokens = max_prefill_tokens_per_step
        self.max_trailing = max_text_tokens + 1  # + the tts_eos row of the streaming layout
        self.eos = tc.codec_eos_token_id
        rows, hidden, dev, dt = max_batch_size, tc.hidden_size, self.device, self.dtype
        self.cache = KVCache(tc, rows, max_model_len, dev, dt)
        self.cp_cache = KVCache(tc.code_predictor, rows, tc.num_code_groups, dev, dt)
        self.hidden = torch.zeros(rows, hidden, device=dev, dtype=dt)
        self.c0 = torch.zeros(rows, dtype=torch.long, device=dev)
        self.trailing = torch.zeros(rows, self.max_trailing + 1, hidden, device=dev, dtype=dt)
        self.trailing_len = torch.zeros(rows, dtype=torch.long, device=dev)
        self.steps = torch.zeros(rows, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=dev)
        self.sampler = BatchSampler(rows, tc.vocab_size, tc.code_predictor.vocab_size, self.eos, dev)
        with torch.inference_mode():
            self.tts_pad = talker.embed_text(torch.tensor(config.tts_pad_token_id, device=dev)).to(dt)
        self.waiting: deque[TalkerRequest] = deque()
        self.running: list[TalkerRequest] = []
        self.num_steps = 0

    # --- requests -------------------------------------------------------------------------------------------
    def add_request(self, request: TalkerRequest) -> None:
        """Queue a request; it is admitted when a row is free. ValueError if it can never fit."""
        length = request.prefill.shape[0]
        if length >= self.max_model_len:
            raise ValueError(f"prompt of {length} positions does not fit max_model_len {self.max_model_len}")
        if request.trailing.shape[0] > self.max_trailing:
            raise ValueError(f"text of {request.trailing.shape[0] - 1} tokens exceeds max_text_tokens "
                             f"{self.max_trailing - 1}")
        # N tokens occupy L + N - 1 slots (the last token is never fed)
        request.max_tokens = min(request.max_tokens, self.max_model_len - length + 1)
        self.waiting.append(request)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request; its row is free before the next step."""
        for request in self.waiting:
            if request.request_id == request_id:
                self.waiting.remove(request)
                return True
        for row, request in enumerate(self.running):
            if request.request_id == request_id:
                self._release_rows([row])
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def stats(self) -> TalkerEngineStats:
        return TalkerEngineStats(num_running=len(self.running), num_waiting=len(self.waiting),
                                 free_rows=self.max_rows - len(self.running), steps=self.num_steps,
                                 request_ids=[r.request_id for r in self.running] + [r.request_id for r in self.waiting])

    # --- the step -------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[FrameOutput]:
        outputs = self._admit()
        if self.running:
            outputs += self._decode()
        self.num_steps += 1
        return outputs

    def _admit(self) -> list[FrameOutput]:
        outputs, budget, finished = [], self.max_prefill_tokens, []
        while self.waiting and len(self.running) < self.max_rows:
            length = self.waiting[0].prefill.shape[0]
            if budget < self.max_prefill_tokens and length > budget:
                break  # the rest waits for the next step: running requests keep their pace
            request = self.waiting.popleft()
            budget -= length
            row = len(self.running)
            self.running.append(request)
            self._prefill(request, row)
            if request.num_tokens >= request.max_tokens:  # a one-token budget gives no frame
                outputs.append(FrameOutput(request.request_id, None, True, "length"))
                finished.append(row)
        self._release_rows(finished)
        return outputs

    def _prefill(self, request: TalkerRequest, row: int) -> None:
        length, trailing = request.prefill.shape[0], request.trailing.shape[0]
        positions = torch.arange(length, device=self.device)[None]
        key_valid = torch.ones(1, length, dtype=torch.bool, device=self.device)
        hidden, logits = self.talker(request.prefill[None].to(self.dtype), positions, self.cache.rows(row, row + 1),
                                     0, key_valid)
        self.hidden[row] = hidden[0]
        self.sampler.set_row(row, request.sampling)
        self.c0[row] = self.sampler.sample_talker(logits, slice(row, row + 1))[0]
        self.trailing[row, :trailing] = request.trailing
        self.trailing[row, trailing] = self.tts_pad
        self.trailing_len[row] = trailing
        self.steps[row] = 0
        self.lengths[row] = length
        request.length, request.num_tokens = length, 1

    def _decode(self) -> list[FrameOutput]:
        b = len(self.running)
        rows = slice(0, b)
        talker = self.talker
        c0 = self.c0[rows]
        rest = talker.code_predictor.predict(self.hidden[rows], talker.embed_codec(c0), self.cp_cache.rows(0, b),
                                             self.sampler.codebook_sampler(rows))
        frame = torch.cat((c0[:, None], rest), dim=1)                                # [B, 16]
        text_index = torch.minimum(self.steps[rows], self.trailing_len[rows])
        text_rows = self.trailing[torch.arange(b, device=self.device), text_index]  # trailing row or tts_pad
        x = talker.embed_frame(frame) + text_rows
        num_slots = max(r.length for r in self.running) + 1
        hidden, logits = talker.decode_step(x, self.lengths[rows], self.cache.rows(0, b), num_slots)
        self.hidden[rows] = hidden
        next_c0 = self.sampler.sample_talker(logits, rows)
        self.c0[rows] = next_c0
        self.lengths[rows] += 1
        self.steps[rows] += 1
        host = torch.cat((frame, next_c0[:, None]), dim=1).cpu().numpy()             # the step's one D2H copy
        outputs, finished = [], []
        for row, request in enumerate(self.running):
            request.length += 1
            request.num_tokens += 1
            request.num_frames += 1
            stop = int(host[row, 16]) == self.eos
            done = stop or request.num_tokens >= request.max_tokens
            outputs.append(FrameOutput(request.request_id, host[row, :16], done,
                                       ("stop" if stop else "length") if done else None))
            if done:
                finished.append(row)
        self._release_rows(finished)
        return outputs

    def _release_rows(self, rows: list[int]) -> None:
        """Free finished rows, moving the last running row into each hole (descending, so no hole is refilled
        from a row that is itself being freed)."""
        for row in sorted(rows, reverse=True):
            last = len(self.running) - 1
            if row != last:
                moved = self.running[last]
                self.cache.copy_row(last, row, moved.length)
                for buf in (self.hidden, self.c0, self.trailing, self.trailing_len, self.steps, self.lengths):
                    buf[row] = buf[last]
                self.sampler.move_row(last, row)
                self.running[row] = moved
            self.running.pop()
