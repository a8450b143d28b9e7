"""Stage 0: the talker with continuous batching (requests join and leave at every step).

A step reads schedule → run → postprocess: the torch-free `TalkerScheduler` picks the rows (admitting waiting
requests within a prefill token budget), the `TalkerRunner` prefills the admitted prompts together and runs one
decode step for every row on the device, and the scheduler turns the step's [B, 17] tokens into frames and frees
finished rows. The serving stage and offline `Qwen3TTS.synthesize` both drive this one loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omni_tts.models.qwen3_tts.config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.talker import Talker

from .talker_runner import TalkerRunner
from .talker_scheduler import FrameOutput, TalkerRequest, TalkerScheduler

__all__ = ["FrameOutput", "TalkerEngine", "TalkerEngineStats", "TalkerRequest"]


@dataclass
class TalkerEngineStats:
    num_running: int
    num_waiting: int
    free_rows: int
    steps: int
    request_ids: list[str] = field(default_factory=list)


class TalkerEngine:
    def __init__(self, talker: Talker, config: Qwen3TTSConfig, max_batch_size: int, max_model_len: int,
                 max_prefill_tokens_per_step: int, max_text_tokens: int, static_shapes: bool = False,
                 cuda_graphs: bool = False) -> None:
        """static_shapes: bucketed decode shapes (what CUDA graphs replay); cuda_graphs: capture them at start-up
        (CUDA only; implies static_shapes)."""
        self.scheduler = TalkerScheduler(max_batch_size, max_model_len, max_prefill_tokens_per_step, max_text_tokens,
                                         config.talker.codec_eos_token_id)
        self.runner = TalkerRunner(talker, config, max_batch_size, max_model_len, self.scheduler.max_trailing,
                                   static_shapes, cuda_graphs)
        self.num_steps = 0

    def add_request(self, request: TalkerRequest) -> None:
        """Queue a request; it is admitted when a row is free. ValueError if it can never fit."""
        self.scheduler.add(request)

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request; its row is free before the next step."""
        moves = self.scheduler.abort(request_id)
        if moves is None:
            return False
        self.runner.move_rows(moves)
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> TalkerEngineStats:
        s = self.scheduler.stats()
        return TalkerEngineStats(s.num_running, s.num_waiting, s.free_rows, self.num_steps, s.request_ids)

    @torch.inference_mode()
    def step(self) -> list[FrameOutput]:
        schedule = self.scheduler.schedule()
        outputs: list[FrameOutput] = []
        if schedule.admitted:
            self.runner.prefill(schedule.admitted, schedule.first_row)
        if schedule.num_rows:
            tokens = self.runner.decode(schedule.num_rows, schedule.num_slots)
            outputs, moves = self.scheduler.postprocess(schedule, tokens)
            self.runner.move_rows(moves)
        self.num_steps += 1
        return outputs
