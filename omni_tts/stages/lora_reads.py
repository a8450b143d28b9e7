"""LoRA adapters read and checked beside the talker's loop (`LoadLoRA`).

Reading an adapter (its safetensors file, a finiteness pass over every tensor, the scale folded into B) takes
milliseconds to seconds; inside the step loop that pause would hit every running stream. A worker thread reads it
and hands the checked adapter back to the loop, which alone touches the engine: it copies the adapter into a free
slot between two steps.
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from omni_tts.models.qwen3_tts.checkpoint_config import TalkerConfig
from omni_tts.models.qwen3_tts.lora import LoRAAdapter, LoRAError, read_adapter

from .messages import FailureKind, LoadLoRA, RequestFailure


@dataclass(frozen=True)
class LoRARead:
    """A finished read: the checked adapter, or why it cannot be loaded."""
    command: LoadLoRA
    adapter: LoRAAdapter | None
    failure: RequestFailure | None


class LoRAReader:
    """One worker thread reading adapters in arrival order; finished reads wait in `finished` for the loop."""

    def __init__(self, config: TalkerConfig, max_rank: int, condition: threading.Condition) -> None:
        self.config, self.max_rank, self.condition = config, max_rank, condition
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-tts-talker-lora")
        self.finished: collections.deque[LoRARead] = collections.deque()

    def submit(self, command: LoadLoRA) -> None:
        future = self.executor.submit(read_adapter, command.path, self.config, self.max_rank)
        future.add_done_callback(lambda done: self._finish(command, done))

    def _finish(self, command: LoadLoRA, future: Future) -> None:
        try:
            read = LoRARead(command, future.result(), None)
        except LoRAError as e:   # the adapter's own fault: its files
            read = LoRARead(command, None, RequestFailure(FailureKind.BAD_INPUT, str(e), "lora_path"))
        except Exception as e:
            read = LoRARead(command, None, RequestFailure.of(e))
        with self.condition:
            self.finished.append(read)
            self.condition.notify_all()

    def has_finished(self) -> bool:
        """Called under the condition (the loop's wait predicate)."""
        return bool(self.finished)

    def take_finished(self) -> list[LoRARead]:
        with self.condition:
            reads = list(self.finished)
            self.finished.clear()
        return reads

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
