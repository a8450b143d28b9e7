"""Stage 1: codec frames → audio with the exact stateful streaming decoder, batched across requests.

Each registered request owns a `DecodingRequest`: a slot of the runner's decoder-state pool (`code2wav_runner.py`,
eager or CUDA graphs). A step is schedule → decode →
postprocess: the scheduler (`code2wav_scheduler.py`) picks pieces of chunks by playback deadline within the per-call
frame budget, pieces of equal length share one batched decoder call (rows at different stream offsets), and each piece
returns only its new samples; a chunk split across steps is sent whole once its last piece is decoded. Context pieces
prime the state and emit nothing. A request's state is freed at its last chunk or on abort. With several lanes, each
lane's calls run on their own thread at the same time as the others' (torch releases the GIL inside its ops).
`measure_frame_budget` sizes the per-call frame budget for the device at stage start.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE
from omni_tts.models.qwen3_tts.speech_decoder import SpeechDecoder

from .code2wav_runner import Code2WavRunner
from .code2wav_scheduler import CodecChunk, Code2WavScheduler, ScheduledPiece

__all__ = ["AudioOutput", "CodecChunk", "Code2WavEngine", "DecodingRequest", "measure_frame_budget"]

logger = logging.getLogger(__name__)

# Calibration: start-up time spent timing the decoder (tests start stages often); within this factor of the best
# per-frame cost, a bigger call buys too little throughput for the latency it adds to every stream.
MAX_CALIBRATION_SECONDS = 1.0
BUDGET_COST_TOLERANCE = 1.1
CALIBRATION_REPEATS = 2  # best of: interference from other processes only ever adds time


@dataclass
class DecodingRequest:
    """One request's slot of decoder state, and the audio of a chunk split across steps (it leaves whole, as cut)."""
    slot: int
    partial_audio: list[np.ndarray] = field(default_factory=list)


@dataclass
class AudioOutput:
    request_id: str
    audio: np.ndarray          # float32 [F * samples_per_frame] at 24 kHz (empty for a bare end marker)
    finished: bool


class Code2WavEngine:
    """Owns the decoder and one stream state per request; a `Code2WavScheduler` picks each step's pieces.

    `frame_budget` bounds each decoder call (one lane's, frames summed over its rows); None means no budget
    (benchmarks time whole batches of chunks). `runner` defaults to the dynamic-shape eager runner; a static-shape
    one (CUDA graphs) shares its buffers across calls, so it takes one lane.
    """

    def __init__(self, decoder: SpeechDecoder, max_batch_size: int, frame_budget: int | None = None,
                 lanes: int = 1, runner: Code2WavRunner | None = None) -> None:
        self.decoder = decoder
        self.runner = runner or Code2WavRunner(decoder, max_batch_size)
        if self.runner.static_shapes and lanes > 1:
            raise ValueError("a static-shape decoder runner shares its buffers across calls: use one lane")
        self.scheduler = Code2WavScheduler(max_batch_size, frame_budget,
                                           decoder.samples_per_frame / SAMPLE_RATE, lanes)
        # lane 0 decodes on the caller's thread; torch ops release the GIL, so the lanes' calls overlap
        self.lane_pool = ThreadPoolExecutor(lanes - 1, thread_name_prefix="code2wav-lane") if lanes > 1 else None
        self.requests: dict[str, DecodingRequest] = {}
        self.num_steps = 0

    def add_request(self, request_id: str) -> None:
        """Pre-register (allocates the stream state) before the first chunk arrives."""
        if request_id not in self.requests:
            self.requests[request_id] = DecodingRequest(self.runner.allocate())
            self.scheduler.add_request(request_id, time.monotonic())

    def add_chunk(self, request_id: str, chunk: CodecChunk) -> bool:
        """Queue a chunk; False if the request is unknown (aborted or never registered): the chunk is dropped.
        ValueError for codes the decoder cannot look up: caught here, they fail one request instead of a decoder
        call (and the stage) for every request batched with it."""
        codes, cfg = chunk.codes, self.decoder.cfg
        if codes.ndim != 2 or codes.shape[1] != cfg.num_quantizers:
            raise ValueError(f"codes of shape {codes.shape}; the decoder takes [frames, {cfg.num_quantizers}]")
        if codes.size and (codes.min() < 0 or codes.max() >= cfg.codebook_size):
            raise ValueError(f"codes in [{codes.min()}, {codes.max()}], outside [0, {cfg.codebook_size})")
        return self.scheduler.add_chunk(request_id, chunk)

    def abort(self, request_id: str) -> bool:
        self.scheduler.abort(request_id)
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.runner.release(request.slot)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @torch.inference_mode()
    def step(self) -> list[AudioOutput]:
        batch = self.scheduler.schedule()
        audio = self._decode(batch)
        self.scheduler.postprocess(batch, time.monotonic())
        outputs = []
        for piece, samples in zip(batch, audio):
            rid = piece.request_id
            request = self.requests[rid]
            if piece.is_last:
                self.runner.release(self.requests.pop(rid).slot)
            if piece.chunk.is_context:  # primes the state; emits only the end marker of a context-only request
                if piece.is_last:
                    outputs.append(AudioOutput(rid, np.zeros(0, np.float32), True))
            elif not piece.ends_chunk:
                request.partial_audio.append(samples)
            else:
                samples = np.concatenate([*request.partial_audio, samples])
                request.partial_audio = []
                outputs.append(AudioOutput(rid, samples, piece.is_last))
        self.num_steps += 1
        return outputs

    def _decode(self, batch: list[ScheduledPiece]) -> list[np.ndarray]:
        """Each piece's new samples; the lanes run at once, and a lane's pieces of equal length share one call."""
        audio: list[np.ndarray] = [np.zeros(0, np.float32)] * len(batch)
        lanes: dict[int, dict[int, list[int]]] = {}  # lane -> piece length -> batch indices
        for i, piece in enumerate(batch):
            if piece.num_frames:
                lanes.setdefault(piece.lane, {}).setdefault(piece.num_frames, []).append(i)
        calls = [list(groups.values()) for groups in lanes.values()]
        others = [self.lane_pool.submit(self._decode_lane, batch, lane) for lane in calls[1:]]
        results = [self._decode_lane(batch, calls[0])] if calls else []
        results += [future.result() for future in others]
        for lane in results:
            for i, samples in lane:
                audio[i] = samples
        return audio

    def _decode_lane(self, batch: list[ScheduledPiece], calls: list[list[int]]) -> list[tuple[int, np.ndarray]]:
        """One lane's decoder calls in turn: (batch index, new samples) per piece."""
        out = []
        for rows in calls:
            codes = np.stack([batch[i].codes for i in rows]).astype(np.int64)             # [B, F, 16]
            slots = [self.requests[batch[i].request_id].slot for i in rows]
            out += zip(rows, self.runner.decode(slots, codes))
        return out


def measure_frame_budget(runner: Code2WavRunner, chunk_frames: int, max_rows: int) -> int:
    """Frames per decoder call (summed over the batch) for this device: where the per-frame cost stops improving.

    Times one call of the runner (eager or graphs) on throwaway streams (best of CALIBRATION_REPEATS, including the copy to the host) for
    the shapes steps run: one row of 1, 2, 4, ... frames below `chunk_frames`, then 1, 2, 4, ... up to `max_rows`
    rows of `chunk_frames`. Growing stops once two sizes in a row did not lower the best per-frame cost, or when
    the next size would overrun MAX_CALIBRATION_SECONDS. The budget is the smallest size whose per-frame cost is
    within BUDGET_COST_TOLERANCE of the best. On a CPU the per-frame cost bottoms out at a few tens of frames
    (bigger calls only add latency); on a GPU it keeps falling with the batch, so the budget comes out large.
    """
    shapes = [(1, 2 ** k) for k in range(chunk_frames.bit_length()) if 2 ** k < chunk_frames]
    shapes += [(2 ** k, chunk_frames) for k in range(max_rows.bit_length()) if 2 ** k < max_rows]
    shapes.append((max_rows, chunk_frames))
    _time_decode(runner, 1, 1)  # warm-up: first-call allocations and thread start-up
    started = time.perf_counter()
    cost: dict[int, float] = {}  # seconds per frame by frames per call
    num_worse = 0
    for rows, frames in shapes:
        num_frames = rows * frames
        best = min(cost.values(), default=float("inf"))
        # predicted at the best per-frame cost so far (it falls with size until the knee)
        if cost and time.perf_counter() - started + CALIBRATION_REPEATS * best * num_frames > MAX_CALIBRATION_SECONDS:
            break
        seconds = min(_time_decode(runner, rows, frames) for _ in range(CALIBRATION_REPEATS))
        cost[num_frames] = seconds / num_frames
        num_worse = 0 if cost[num_frames] < best else num_worse + 1
        if num_worse == 2:
            break
    logger.debug("code2wav decoder ms per frame by frames per call: %s",
                 ", ".join(f"{n}: {c * 1e3:.2f}" for n, c in cost.items()))
    best = min(cost.values())
    return min(n for n, c in cost.items() if c <= BUDGET_COST_TOLERANCE * best)


def _time_decode(runner: Code2WavRunner, rows: int, frames: int) -> float:
    slots = [runner.allocate() for _ in range(rows)]
    codes = np.zeros((rows, frames, runner.decoder.cfg.num_quantizers), dtype=np.int64)
    started = time.perf_counter()
    runner.decode(slots, codes)
    seconds = time.perf_counter() - started
    for slot in slots:
        runner.release(slot)
    return seconds
