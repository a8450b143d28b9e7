"""Stage 0: the talker with continuous batching (requests join and leave at every step).

A step reads schedule → run → postprocess: the torch-free `TalkerScheduler` picks the rows (admitting waiting
requests within a prefill token budget), the `TalkerRunner` prefills the admitted prompts together and runs one
decode step for every row on the device, and the scheduler turns the step's [B, 17] tokens into frames and frees
finished rows. The serving stage and offline synthesis (`offline.py`) both drive this one loop.

A request may start before its text is whole (`TalkerRequest.text_done` False) and receive the rest by
`append_text`; a row whose next step needs text that has not arrived is parked outside the batch meanwhile.
"""
from __future__ import annotations

import torch

from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.talker import Talker

from .talker_runner import TalkerRunner
from .talker_scheduler import FrameOutput, TalkerRequest, TalkerScheduler, TalkerSchedulerStats, max_trailing_rows

__all__ = ["FrameOutput", "TalkerEngine", "TalkerRequest"]


class TalkerEngine:
    def __init__(self, talker: Talker, config: Qwen3TTSConfig, max_batch_size: int, max_model_len: int,
                 max_prefill_tokens_per_step: int, max_text_tokens: int, static_shapes: bool = False,
                 cuda_graphs: bool = False) -> None:
        """static_shapes: bucketed decode shapes (what CUDA graphs replay); cuda_graphs: capture them at start-up
        (CUDA only; implies static_shapes)."""
        self.runner = TalkerRunner(talker, config, max_batch_size, max_model_len, max_trailing_rows(max_text_tokens),
                                   static_shapes, cuda_graphs)
        self.scheduler = TalkerScheduler(max_batch_size, self.runner.num_buffer_rows, max_model_len,
                                         max_prefill_tokens_per_step, max_text_tokens, config.talker.codec_eos_token_id)
        self.num_steps = 0

    def add_request(self, request: TalkerRequest) -> None:
        """Queue a request; it is admitted when a row is free. ValueError if it can never fit."""
        self.scheduler.add(request)

    def append_text(self, request_id: str, rows: torch.Tensor, max_tokens: int, done: bool) -> bool:
        """rows: [k, H] the next trailing text rows of a request added with open text (tts_eos last when done);
        max_tokens: its token limit for the text so far. False if the request has ended (by EOS, or aborted);
        ValueError beyond max_text_tokens."""
        found = self.scheduler.append_text(request_id, rows.shape[0], max_tokens, done)
        if found is None:
            return False
        request, row, start = found
        if row is None:  # not prefilled yet: the prefill writes them
            request.trailing = torch.cat((request.trailing, rows))
        else:
            self.runner.append_trailing(row, start, rows)
        return True

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request; its row is free before the next step."""
        moves = self.scheduler.abort(request_id)
        if moves is None:
            return False
        self.runner.move_rows(moves)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def waiting_for_text(self) -> list[str]:
        return self.scheduler.waiting_for_text()

    def stats(self) -> TalkerSchedulerStats:
        return self.scheduler.stats()

    @torch.inference_mode()
    def step(self) -> list[FrameOutput]:
        schedule = self.scheduler.schedule()
        outputs: list[FrameOutput] = []
        self.runner.move_rows(schedule.unparked)
        if schedule.admitted:
            self.runner.prefill(schedule.admitted, schedule.first_row)
        self.runner.move_rows(schedule.parked)
        if schedule.num_rows:
            tokens = self.runner.decode(schedule.num_rows, schedule.num_slots)
            outputs, moves = self.scheduler.postprocess(schedule, tokens)
            self.runner.move_rows(moves)
        self.num_steps += 1
        return outputs
