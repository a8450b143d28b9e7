"""Stage 0: the talker with continuous batching (requests join and leave at every step).

A step reads schedule → run → postprocess: the torch-free `TalkerScheduler` picks the rows (admitting waiting
requests within a prefill token budget, a step later when a stream is about to run dry), the `TalkerRunner`
prefills the admitted prompts together and runs one decode step for every row on the device, and the scheduler
turns the step's [B, 17] tokens into frames and frees finished rows. The serving stage and offline synthesis (`offline.py`) both drive this one loop.

A request may start before its text is whole (`TalkerRequest.text_done` False) and receive the rest by
`append_text`; a row whose next step needs text that has not arrived is parked outside the batch meanwhile.

LoRA adapters (max_loras > 0) are loaded into the runner's slots by name between steps; a request names its
adapter (`TalkerRequest.lora`) and rows with different adapters, and none, run in one step. An adapter that a
request holds (waiting, running or parked) is not unloaded: the unload is refused, not deferred, so the caller gets
its answer at once and decides (retry, or abort those requests); a deferred unload would need a draining state
that new requests must also be refused by.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
from omni_tts.models.qwen3_tts.lora import LoRAAdapter
from omni_tts.models.qwen3_tts.prompt import RequestError
from omni_tts.models.qwen3_tts.talker import Talker

from .talker_runner import TalkerRunner
from .talker_scheduler import FrameOutput, TalkerRequest, TalkerScheduler, TalkerSchedulerStats, max_trailing_rows

__all__ = ["FrameOutput", "TalkerEngine", "TalkerRequest"]


class TalkerEngine:
    def __init__(self, talker: Talker, config: Qwen3TTSConfig, max_batch_size: int, max_model_len: int,
                 max_prefill_tokens_per_step: int, max_text_tokens: int, static_shapes: bool = False,
                 cuda_graphs: bool = False, max_loras: int = 0, max_lora_rank: int = 16,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """static_shapes: bucketed prefill and decode shapes (what CUDA graphs replay); cuda_graphs: capture them at
        start-up (CUDA only; implies static_shapes); max_loras: LoRA adapters loaded at once (0: no LoRA rows, the
        plain step), each of rank <= max_lora_rank; clock: the scheduler's, for the rows' playback deadlines."""
        self.runner = TalkerRunner(talker, config, max_batch_size, max_model_len, max_trailing_rows(max_text_tokens),
                                   static_shapes, cuda_graphs, max_loras, max_lora_rank, max_prefill_tokens_per_step)
        self.scheduler = TalkerScheduler(max_batch_size, self.runner.num_buffer_rows, max_model_len,
                                         max_prefill_tokens_per_step, max_text_tokens, config.talker.codec_eos_token_id,
                                         clock)
        self.num_steps = 0
        self.loras: dict[str, int] = {}   # loaded adapters: name → slot (1..max_loras)

    def add_request(self, request: TalkerRequest) -> None:
        """Queue a request; it is admitted when a row is free. ValueError if it can never fit; RequestError('model')
        if it names an adapter that is not loaded."""
        if request.lora is not None:
            self.check_lora(request.lora)
            request.lora_slot = self.loras[request.lora]
        self.scheduler.add(request)

    def check_lora(self, name: str) -> None:
        """RequestError('model') unless an adapter of this name is loaded."""
        if name not in self.loras:
            raise RequestError("model", f"no LoRA adapter named {name!r} is loaded")

    def load_lora(self, name: str, adapter: LoRAAdapter) -> None:
        """Load a checked adapter (lora.read_adapter) into a free slot, between two steps: running rows keep theirs.
        ValueError if the name is taken, no slot is free or its rank exceeds the slots'."""
        lora = self.runner.lora
        if lora is None:
            raise ValueError("LoRA adapters are off (max_loras: 0)")
        if name in self.loras:
            raise ValueError(f"a LoRA adapter named {name!r} is loaded already")
        if adapter.rank > lora.max_rank:
            raise ValueError(f"{adapter.path}: rank {adapter.rank} exceeds max_lora_rank {lora.max_rank}")
        free = sorted(set(range(1, lora.max_loras + 1)) - set(self.loras.values()))
        if not free:
            raise ValueError(f"max_loras ({lora.max_loras}) adapters are loaded; unload one first")
        lora.load(free[0], adapter)
        self.loras[name] = free[0]

    def unload_lora(self, name: str) -> None:
        """Free an adapter's slot. ValueError if it is not loaded, or requests hold it (see the module doc)."""
        slot = self.loras.get(name)
        if slot is None:
            raise ValueError(f"no LoRA adapter named {name!r} is loaded")
        holders = [r.request_id for r in self.scheduler.requests() if r.lora_slot == slot]
        if holders:
            raise ValueError(f"LoRA adapter {name!r} is in use by {len(holders)} request(s)")
        assert self.runner.lora is not None
        self.runner.lora.clear(slot)
        del self.loras[name]

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
