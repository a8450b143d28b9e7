"""The talker's device side: per-row buffers, batched prefill, and the decode step (eager or CUDA graphs).

Each running request owns one row of preallocated buffers: its KV-cache row, last hidden state, pending c0,
trailing-text rows (+ the tts_pad row after them), sampling state, and its slice of the step's output. A decode
step reads and writes only those buffers, top to bottom: the code predictor's 15 forwards, each followed by its
draw, complete the frame; the talker's forward; the next c0's draw. With a fixed number of rows and attention
slots it has fixed shapes: `static_shapes` rounds both up to a bucket (padding rows compute throw-away values in
free rows), which is what a CUDA graph needs. A static step cannot skip what only some rows need, so it comes in
two sampling path sets (STATIC_PATHS), picked per step from the rows' host-side parameters: candidates only (every
sampled row keeps a small top-k, the checkpoints' default) or every path. On CUDA one graph per (rows, slots)
bucket and path set is captured at start-up and replayed; on CPU the same step runs eagerly, static (tested to
give the dynamic path's codes) or not (each draw then runs only the paths its rows need). Either way one [B, 17]
device→host copy per step (through pinned memory, waited for by an event on the talker's stream) is the only
sync. The buffers hold `num_buffer_rows` = max_rows + the largest padding (at least 1) rows: parked rows
(waiting for text) live at the top, where no bucket's padding reaches (talker_scheduler.py).

The prefill: with static shapes the admitted prompts run in groups of 1-MAX_PREFILL_BATCH prompts at a length
bucket (talker_prefill.py), each on a staging KV cache scattered into its rows by a row index, so one graph per
(prompts, length) serves any rows; on CUDA every one is captured at start-up with the decode graphs (one memory
pool), and an admission costs a replay per group instead of a launch-bound eager forward that every running stream
waits for. A prompt longer than the largest bucket is prefilled eagerly (dynamic shapes), and without static shapes
all prompts are, in one right-padded forward. The first c0 is drawn outside the graph, from the logits the prefill
left in `logits`. Its inputs reach the GPU through pinned memory, without blocking (device_copy.py).

LoRA rows (max_loras > 0): the adapters sit in static slot buffers (lora_slots.py) and each row holds its adapter
slot (0 = none) in `adapter_slots`, set at prefill and moved with the row; every forward (prefill, the talker's and
the code predictor's decode) adds each row's adapter to the layers' linears. Loading an adapter between two steps
copies into its slot, so the graphs stay valid. A forward runs the LoRA path only when one of its rows has an
adapter (the slots are mirrored on the host, read without a sync): with max_loras 0, or rows on the base model
alone, the step is the plain one, kernel for kernel. With max_loras > 0 the graphs come in both kinds, twice as
many (a row without an adapter gets the same values from either).
"""
from __future__ import annotations

import itertools
import logging

import numpy as np
import torch

from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.device_copy import to_device
from omni_tts.models.qwen3_tts.layers import KVCache
from omni_tts.models.qwen3_tts.lora_slots import LoRASlots, StackLoRA
from omni_tts.models.qwen3_tts.sampling import STATIC_PATHS, BatchSampler, SamplingPaths, warp_and_sample
from omni_tts.models.qwen3_tts.talker import Talker

from .buckets import batch_buckets, bucket
from .cuda_graphs import capture
from .talker_prefill import MAX_PREFILL_BATCH, StaticPrefill, prefill_groups
from .talker_scheduler import RowMove, TalkerRequest

logger = logging.getLogger(__name__)

MIN_SLOT_BUCKET = 256
LORA_KINDS = {False: (False,), True: (False, True)}   # by whether the runner has LoRA slots: the steps' kinds


def slot_buckets(max_model_len: int) -> list[int]:
    """Powers of two from MIN_SLOT_BUCKET, capped by max_model_len (attention cost follows the bucket)."""
    buckets, size = [], MIN_SLOT_BUCKET
    while size < max_model_len:
        buckets.append(size)
        size *= 2
    return buckets + [max_model_len]


def _num_buffer_rows(max_rows: int, static_shapes: bool) -> int:
    """Rows of the device buffers: max_rows, plus what a bucket pads a batch with beyond its rows (so padding
    never reaches a parked row), at least one (a parked row moves back to row B even when all rows are in use)."""
    buckets = batch_buckets(max_rows)
    padding = max(bucket(buckets, b) - b for b in range(1, max_rows + 1)) if static_shapes else 0
    return max_rows + max(padding, 1)


class TalkerRunner:
    def __init__(self, talker: Talker, config: Qwen3TTSConfig, max_rows: int, max_model_len: int,
                 max_trailing: int, static_shapes: bool = False, cuda_graphs: bool = False, max_loras: int = 0,
                 max_lora_rank: int = 16, max_prefill_tokens: int = 1024) -> None:
        tc = config.talker
        self.talker, self.config = talker, config
        self.device, self.dtype = talker.codec_head.weight.device, talker.codec_head.weight.dtype
        self.max_rows, self.max_model_len = max_rows, max_model_len
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.static_shapes = static_shapes or self.cuda_graphs
        # the fused attention reads each row's keys up to its own slot: one slot bucket, the whole cache (a graph per
        # rows bucket); the plain attention's cost follows the bucket
        self.batch_buckets = batch_buckets(max_rows)
        self.slot_buckets = [max_model_len] if talker.kernels is not None else slot_buckets(max_model_len)
        self.num_buffer_rows = _num_buffer_rows(max_rows, self.static_shapes)
        rows, hidden, dev, dt = self.num_buffer_rows, tc.hidden_size, self.device, self.dtype
        self.cache = KVCache(tc, rows, max_model_len, dev, dt)
        self.cp_cache = KVCache(tc.code_predictor, rows, tc.num_code_groups, dev, dt)
        self.hidden = torch.zeros(rows, hidden, device=dev, dtype=dt)
        self.c0 = torch.zeros(rows, dtype=torch.long, device=dev)
        self.trailing = torch.zeros(rows, max_trailing + 1, hidden, device=dev, dtype=dt)
        self.trailing_len = torch.zeros(rows, dtype=torch.long, device=dev)
        self.steps = torch.zeros(rows, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=dev)
        self.row_ids = torch.arange(rows, device=dev)
        self.lora = LoRASlots(tc, max_loras, max_lora_rank, dev, dt) if max_loras else None
        self.adapter_slots = torch.zeros(rows, dtype=torch.long, device=dev)   # each row's LoRA slot, 0 = none
        self.host_adapter_slots = np.zeros(rows, dtype=np.int64)               # the same, read without a sync
        self.tokens = torch.zeros(rows, tc.num_code_groups + 1, dtype=torch.long, device=dev)  # frame + next c0
        # the step's tokens reach the host through pinned memory, waited for by an event on this stream alone (a
        # copy to pageable memory is synchronous, and a device-wide sync would wait for the decoder's stream too);
        # on the CPU they are on the host already
        on_cuda = dev.type == "cuda"
        self.host_tokens = torch.zeros_like(self.tokens, device="cpu", pin_memory=True) if on_cuda else self.tokens
        self.tokens_copied = torch.cuda.Event() if on_cuda else None
        self.sampler = BatchSampler(rows, tc.vocab_size, tc.code_predictor.vocab_size, tc.codec_eos_token_id, dev)
        with torch.inference_mode():
            self.tts_pad = talker.embed_text(torch.tensor(config.tts_pad_token_id, device=dev)).to(dt)
            self.cp_positions = talker.code_predictor.frame_positions(dev, dt)
        # static shapes: the admitted rows' logits (the prefill writes them by row index), the prefill's buffers
        self.logits = torch.zeros(rows, tc.vocab_size, device=dev, dtype=dt) if self.static_shapes else None
        self.static_prefill = (StaticPrefill(talker, tc, min(max_prefill_tokens, max_model_len - 1),
                                             max_prefill_tokens, self.cache, self.hidden, self.logits,
                                             self.adapter_slots, self.lora) if self.static_shapes else None)
        self.graphs: dict[tuple[int, int, SamplingPaths, bool], torch.cuda.CUDAGraph] = {}  # (rows, slots, paths, lora)
        if self.cuda_graphs:
            self.capture_graphs()

    # --- prefill --------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, requests: list[TalkerRequest], first_row: int) -> None:
        """Prefill the admitted prompts into rows first_row.., and sample each row's first c0. With static shapes
        in groups of static shapes (talker_prefill.py; a graph each on CUDA), a prompt longer than the largest
        bucket by the dynamic prefill alone; without, all in one dynamic forward."""
        k = len(requests)
        rows = slice(first_row, first_row + k)
        lengths = to_device(torch.tensor([r.prompt_len for r in requests]), self.device)
        if self.lora is not None:
            self.host_adapter_slots[rows] = [r.lora_slot for r in requests]
            self.adapter_slots[rows] = to_device(torch.from_numpy(self.host_adapter_slots[rows]), self.device)
        if self.static_prefill is None:
            self.hidden[rows], logits = self._prefill_dynamic(requests, first_row, lengths)
        else:
            self._prefill_static(requests, first_row, lengths)
            logits = self.logits[rows]
        for i, request in enumerate(requests):
            self.sampler.set_row(first_row + i, request.sampling)
            self.append_trailing(first_row + i, 0, request.trailing)
        talker_paths, _ = self.sampler.paths(rows)
        self.c0[rows] = self.sampler.sample_talker(logits, rows, self.sampler.noise_keys(rows)[:, 0], talker_paths,
                                                   self.talker.kernels)
        self.steps[rows] = 0
        self.lengths[rows] = lengths

    def _prefill_static(self, requests: list[TalkerRequest], first_row: int, lengths: torch.Tensor) -> None:
        """The prompts in static-shape groups (their hidden states and logits into self.hidden and self.logits),
        the ones beyond the largest bucket each by the dynamic prefill."""
        prefill = self.static_prefill
        groups, eager = prefill_groups([r.prompt_len for r in requests], prefill.length_buckets, prefill.capacity)
        for length, members in groups:
            rows = [first_row + i for i in members]
            prefill.prefill([requests[i].prefill for i in members], rows, length, self._has_adapter_rows(rows))
        for i in eager:
            row = first_row + i
            self.hidden[row:row + 1], self.logits[row:row + 1] = self._prefill_dynamic([requests[i]], row,
                                                                                      lengths[i:i + 1])

    def _prefill_dynamic(self, requests: list[TalkerRequest], first_row: int,
                         lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Several prompts in one forward (right-padded to the longest; padding keys land beyond each row's length,
        where the first decode steps overwrite them and no mask ever reaches) into rows first_row..: their last
        hidden states [k, H] and logits."""
        k, longest = len(requests), max(r.prompt_len for r in requests)
        embeds = torch.zeros(k, longest, self.hidden.shape[1], device=self.device, dtype=self.dtype)
        for i, request in enumerate(requests):
            embeds[i, :request.prompt_len] = request.prefill
        key_valid = torch.arange(longest, device=self.device)[None] < lengths[:, None]
        rows = slice(first_row, first_row + k)
        lora = self._lora_rows(rows)[0] if self._has_adapter_rows(rows) else None
        return self.talker.prefill(embeds, lengths, self.cache.rows(first_row, first_row + k), key_valid, lora)

    @torch.inference_mode()
    def append_trailing(self, row: int, start: int, rows: torch.Tensor) -> None:
        """rows: [k, H] trailing text rows from index `start` of the row's trailing text; tts_pad after them
        (what a step past the text reads)."""
        end = start + rows.shape[0]
        self.trailing[row, start:end] = rows
        self.trailing[row, end] = self.tts_pad
        self.trailing_len[row] = end

    # --- decode ---------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def decode(self, num_rows: int, num_slots: int) -> np.ndarray:
        """One step for rows 0..num_rows-1 attending over num_slots slots; returns their [num_rows, 17] tokens."""
        rows = slice(0, num_rows)
        lora = self._has_adapter_rows(rows)
        if self.static_shapes:
            paths = self.sampler.static_paths(rows)
            key = (bucket(self.batch_buckets, num_rows), bucket(self.slot_buckets, num_slots), paths, lora)
            graph = self.graphs.get(key)
            if graph is not None:
                graph.replay()
            else:
                self._decode_rows(key[0], key[1], paths, paths, lora)
        else:
            self._decode_rows(num_rows, num_slots, *self.sampler.paths(rows), lora)
        # the step's one D2H copy and its one wait
        host = self.host_tokens[:num_rows]
        if self.tokens_copied is not None:
            host.copy_(self.tokens[:num_rows], non_blocking=True)
            self.tokens_copied.record()
            self.tokens_copied.synchronize()
        return host.numpy().copy()  # the buffers are the next step's

    def _decode_rows(self, b: int, num_slots: int, talker_paths: SamplingPaths, codebook_paths: SamplingPaths,
                     lora: bool) -> None:
        """The step body, shape-static in (b, num_slots): every row's frame, the talker fed the whole frame + the
        row's text, the next c0 drawn; results land in self.tokens. What a CUDA graph captures, as is.
        talker_paths, codebook_paths: the sampling paths the c0 and the codebook draws run; lora: whether the
        forwards add the rows' adapters."""
        rows, talker = slice(0, b), self.talker
        talker_lora, predictor_lora = self._lora_rows(rows) if lora else (None, None)
        keys = self.sampler.noise_keys(rows)   # [B, 16] the step's 16 draws share the rows' token index: one pass
        frame = self.predict_frame(rows, keys, codebook_paths, predictor_lora)         # [B, 16]
        text_index = torch.minimum(self.steps[rows], self.trailing_len[rows])
        x = talker.embed_frame(frame) + self.trailing[self.row_ids[rows], text_index]  # trailing row or tts_pad
        # a padding row (a free row of a bucket) keeps counting: clamp so its throw-away key stays in the cache
        slots = self.lengths[rows].clamp(max=self.max_model_len - 1)
        hidden, logits = talker.decode_step(x, slots, self.cache.rows(0, b), num_slots, talker_lora)
        next_c0 = self.sampler.sample_talker(logits, rows, keys[:, 0], talker_paths, talker.kernels)
        self.hidden[rows] = hidden
        self.c0[rows] = next_c0
        self.lengths[rows] += 1
        self.steps[rows] += 1
        self.tokens[rows, :-1] = frame
        self.tokens[rows, -1] = next_c0

    def predict_frame(self, rows: slice, keys: torch.Tensor, paths: SamplingPaths,
                      lora: StackLoRA | None = None) -> torch.Tensor:
        """[B, 16] the frame of `rows`: their pending c0, then codebooks 1..15, each the code predictor's forward
        over the codebooks before it (with the rows' adapters `lora`) and a draw (at stream j of keys [B, 16]) with
        the rows' code-predictor sampling."""
        predictor, warpers = self.talker.code_predictor, self.sampler.codebooks.rows(rows)
        cache = self.cp_cache.rows(rows.start, rows.stop)
        codes = [self.c0[rows]]
        x = predictor.frame_inputs(self.hidden[rows], self.talker.embed_codec(codes[0]))
        for j in range(1, predictor.num_code_groups):
            logits = predictor.decode_step(x, j, cache, self.cp_positions, lora)
            codes.append(warp_and_sample(logits, warpers, keys[:, j], paths, self.talker.kernels))
            if j + 1 < predictor.num_code_groups:
                x = predictor.embed_codebook(codes[-1], j)
        return torch.stack(codes, dim=1)

    def _has_adapter_rows(self, rows: slice | list[int]) -> bool:
        return self.lora is not None and bool(self.host_adapter_slots[rows].any())

    def _lora_rows(self, rows: slice) -> tuple[StackLoRA, StackLoRA]:
        """The talker's and the code predictor's adapters of `rows` (padding rows' too: thrown away)."""
        assert self.lora is not None
        return self.lora.forward_rows(self.adapter_slots[rows])

    def capture_graphs(self) -> None:
        """Every prefill group shape (talker_prefill.py) first, then one CUDA graph per decode (rows, slots)
        bucket, sampling path set and (with LoRA slots) with and without the adapters, largest first so smaller
        graphs reuse the memory pool. Two path sets double the decode graphs, and buy a replay without the sorted
        vocabulary's sorts and per-id noise, most of a step's kernels, in the common case (every row keeps a small
        top-k); the LoRA kinds double every graph again, and buy rows on the base model the plain forwards. The
        warm-up and captured runs touch only free rows (nothing runs yet); their state is reset after."""
        lora_kinds = LORA_KINDS[self.lora is not None]
        with torch.inference_mode():
            pool = self.static_prefill.capture_graphs(lora_kinds)
            for slots in reversed(self.slot_buckets):
                for rows in reversed(self.batch_buckets):
                    for paths, lora in itertools.product(STATIC_PATHS, lora_kinds):
                        graph, _ = capture(lambda: self._decode_rows(rows, slots, paths, paths, lora), self.device,
                                           pool)
                        pool = graph.pool()
                        self.graphs[(rows, slots, paths, lora)] = graph
            torch.cuda.synchronize(self.device)
            for buffer in (self.lengths, self.steps, self.trailing_len, self.c0):
                buffer.zero_()
        logger.info("talker: captured %d decode CUDA graphs (rows %s x slots %s x %d sampling path sets x %s) and "
                    "%d prefill graphs (1-%d prompts x lengths %s)", len(self.graphs), self.batch_buckets,
                    self.slot_buckets, len(STATIC_PATHS), "with and without LoRA" if self.lora is not None else
                    "no LoRA", len(self.static_prefill.graphs), MAX_PREFILL_BATCH, self.static_prefill.length_buckets)

    # --- rows -----------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def move_rows(self, moves: list[RowMove]) -> None:
        """Compaction after requests leave, parking and unparking: row src's state (and its first `length` cache
        slots) to row dst."""
        for move in moves:
            self.cache.copy_row(move.src, move.dst, move.length)
            for buffer in (self.hidden, self.c0, self.trailing, self.trailing_len, self.steps, self.lengths,
                           self.adapter_slots):
                buffer[move.dst] = buffer[move.src]
            self.sampler.move_row(move.src, move.dst)
            self.host_adapter_slots[move.dst] = self.host_adapter_slots[move.src]
