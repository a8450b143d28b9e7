"""Code2wav's device side: every stream's decoder state in per-slot buffers, and the decoder call (eager or graphs).

A registered request owns one slot of a `DecoderStreamState` pool (every state tensor [capacity, ...]; the pool
doubles when full). A decoder call for rows at slots s_1..s_n and F frames gathers their states into a batch state
(the state is one arena a stream, decoder_state.StateLayout: one `index_select` for it and one for the positions,
the slots staged through pinned memory and copied without blocking), decodes, and scatters the rows back (two
`index_copy_`). With `static_shapes` every call has one of a fixed set of shapes, what a
CUDA graph needs: the batch state and the codes are fixed buffers, rows are padded up to a rows bucket (padding
rows read some row's state and are never written back), and F frames run as a sequence of `FRAME_SIZES` pieces (the
streaming decoder is exact for any split). On CUDA one graph per (rows bucket, frame size) is captured at start-up,
largest first, sharing one memory pool. A first chunk and a steady chunk are the same call on different state (a new
stream's slot is zeros), so one set of graphs serves both. On the CPU the static path runs eagerly (tested equal to
the dynamic one).
"""
from __future__ import annotations

import logging

import numpy as np
import torch

from omni_tts.models.qwen3_tts.speech_decoder import SpeechDecoder

from .buckets import batch_buckets, bucket
from .cuda_graphs import capture

logger = logging.getLogger(__name__)

# Captured frame counts: 1-6 cover first chunks and short tails without a split; 8/12/16/25 cover the 25-frame
# steady chunk in one call and any split of it in at most three.
FRAME_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16, 25)


def frame_pieces(num_frames: int) -> list[int]:
    """num_frames as captured frame sizes, largest first: 25 -> [25], 7 -> [6, 1], 40 -> [25, 12, 3]."""
    pieces = []
    while num_frames:
        size = max(s for s in FRAME_SIZES if s <= num_frames)
        pieces.append(size)
        num_frames -= size
    return pieces


class Code2WavRunner:
    def __init__(self, decoder: SpeechDecoder, max_rows: int, capacity: int | None = None,
                 static_shapes: bool = False, cuda_graphs: bool = False) -> None:
        self.decoder = decoder
        self.device = decoder.pre_conv.conv.weight.device
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.static_shapes = static_shapes or self.cuda_graphs
        self.pool = decoder.new_stream_state(capacity or max_rows)
        self.free_slots = list(range(self.pool.batch_size))[::-1]
        self.rows_buckets = batch_buckets(max_rows)
        # a call's slots and codes are staged in pinned host memory on a GPU: the copies to the device then run
        # without blocking the host (from pageable memory they are synchronous)
        pinned = self.device.type == "cuda"
        self.host_slots = torch.zeros(max_rows, dtype=torch.long, pin_memory=pinned)
        self.host_codes = torch.zeros(max_rows * max(FRAME_SIZES) * decoder.cfg.num_quantizers, dtype=torch.long,
                                      pin_memory=pinned)
        # ... and the audio comes back the same way, all of a call's pieces waited for once, by an event on this
        # thread's stream (the fused layout's talker runs on another stream of the same device)
        self.host_audio = torch.zeros(max_rows * max(FRAME_SIZES) * decoder.samples_per_frame, pin_memory=pinned)
        self.audio_copied = torch.cuda.Event() if pinned else None
        if self.static_shapes:
            self.batch = decoder.new_stream_state(max_rows)
            self.codes = torch.zeros(max_rows, decoder.cfg.num_quantizers, max(FRAME_SIZES), dtype=torch.long,
                                     device=self.device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if self.cuda_graphs:
            self.capture_graphs()

    # --- slots ----------------------------------------------------------------------------------------------------
    def allocate(self) -> int:
        """A slot for a new stream, its state zeroed (position 0)."""
        if not self.free_slots:
            self._grow()
        slot = self.free_slots.pop()
        self.pool.zero_rows(slot, slot + 1)
        return slot

    def release(self, slot: int) -> None:
        self.free_slots.append(slot)

    def _grow(self) -> None:
        """Double the pool (a copy; the graphs read only the batch buffers, so they stay valid)."""
        old = self.pool
        self.pool = self.decoder.new_stream_state(2 * old.batch_size)
        self.pool.position[:old.batch_size] = old.position
        self.pool.arena[:old.batch_size] = old.arena
        self.free_slots = list(range(old.batch_size, self.pool.batch_size))[::-1] + self.free_slots
        logger.info("code2wav: decoder state pool grown to %d streams", self.pool.batch_size)

    # --- the decoder call -----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, slots: list[int], codes: np.ndarray) -> np.ndarray:
        """codes [n, F, 16] int64 for the streams at `slots` (n <= max_rows) -> their new audio [n, F *
        samples_per_frame] (float32, on the host); the streams' states advance by F frames. The dynamic runner may
        be called from several threads at once (lanes) for different slots; the static one from one thread."""
        if not self.static_shapes:
            return self._decode_dynamic(slots, codes)
        n, num_frames = codes.shape[:2]
        rows = bucket(self.rows_buckets, n)
        self.host_slots[:n] = torch.as_tensor(slots)
        self.host_slots[n:rows] = slots[0]   # padding rows read a real row's state; it is never written back
        index = self.host_slots[:rows].to(self.device, non_blocking=True)
        codes_t = self._staged(codes).to(self.device, non_blocking=True).transpose(1, 2)       # [n, 16, F]
        batch = self.batch.rows(0, rows)
        self.pool.gather_into(index, batch)
        pieces = frame_pieces(num_frames)
        staged = self._host_audio(n * num_frames * self.decoder.samples_per_frame)
        audio, start = [], 0
        for size in pieces:
            self.codes[:n, :, :size] = codes_t[:, :, start:start + size]
            offset = n * start * self.decoder.samples_per_frame
            piece = staged[offset:offset + n * size * self.decoder.samples_per_frame].view(n, -1)  # contiguous
            piece.copy_(self._run(rows, size)[:n].float(), non_blocking=True)  # queued before the graph's next replay
            audio.append(piece.numpy())
            start += size
        self.pool.scatter(index[:n], batch.rows(0, n))
        if self.audio_copied is not None:
            self.audio_copied.record()
            self.audio_copied.synchronize()
        return np.concatenate(audio, axis=1)  # a copy: the staging buffer is the next call's

    def _host_audio(self, samples: int) -> torch.Tensor:
        """The audio staging buffer's first `samples` floats (grown for a long context chunk)."""
        if self.host_audio.numel() < samples:
            self.host_audio = torch.zeros(samples, pin_memory=self.host_audio.is_pinned())
        return self.host_audio[:samples]

    def _staged(self, codes: np.ndarray) -> torch.Tensor:
        """codes as a tensor in the staging buffer (grown for a long context chunk); each call ends with a copy of
        its audio to the host, so the previous call's copy out of the buffer is done when this one overwrites it."""
        size = codes.size
        if self.host_codes.numel() < size:
            self.host_codes = torch.zeros(size, dtype=torch.long, pin_memory=self.host_codes.is_pinned())
        staged = self.host_codes[:size].view(codes.shape)
        staged.copy_(torch.from_numpy(codes))
        return staged

    def _decode_dynamic(self, slots: list[int], codes: np.ndarray) -> np.ndarray:
        codes_t = torch.from_numpy(codes).to(self.device).transpose(1, 2)
        if len(slots) == 1:  # one stream: decode on its slot's rows in place, no copies
            return self.decoder.decode_chunk(codes_t, self.pool.rows(slots[0], slots[0] + 1)).float().cpu().numpy()
        index = torch.tensor(slots, device=self.device)
        state = self.pool.gather(index)
        audio = self.decoder.decode_chunk(codes_t, state).float().cpu().numpy()
        self.pool.scatter(index, state)
        return audio

    def _run(self, rows: int, frames: int) -> torch.Tensor:
        """The static call: self.codes[:rows, :, :frames] on self.batch's first `rows` rows -> audio [rows, ...]."""
        captured = self.graphs.get((rows, frames))
        if captured is not None:
            captured[0].replay()
            return captured[1]
        return self.decoder.decode_chunk(self.codes[:rows, :, :frames], self.batch.rows(0, rows))

    def capture_graphs(self) -> None:
        """One CUDA graph per (rows bucket, frame size), largest first so the smaller ones reuse its memory pool.
        The warm-up and captured calls decode zero codes on the batch buffers (no stream's state); zeroed after."""
        pool = None
        with torch.inference_mode():
            for frames in sorted(FRAME_SIZES, reverse=True):
                for rows in reversed(self.rows_buckets):
                    graph, out = capture(lambda: self._run(rows, frames), self.device, pool)
                    pool = graph.pool()
                    self.graphs[(rows, frames)] = (graph, out)
            torch.cuda.synchronize(self.device)
            self.batch.zero_rows(0, self.batch.batch_size)
        logger.info("code2wav: captured %d CUDA graphs (rows %s x frames %s)", len(self.graphs), self.rows_buckets,
                    list(FRAME_SIZES))
