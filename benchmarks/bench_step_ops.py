"""How many aten ops one static-shape talker step runs on the CPU: what a CUDA graph of it replays as kernels.

    PYTHONPATH=$PWD python benchmarks/bench_step_ops.py [--rows 8] [--checkpoint DIR] [--top N]

The checkpoint defaults to the tiny fixture. For each sampling case (greedy; top-k 50, the checkpoints' default,
which the candidates path serves; top-k off, which needs the sorted vocabulary too) it prefills `rows` requests and
counts the ops of one `decode` with static_shapes=True (the eager twin of the captured step), all ops and those that
are not views (a view launches no kernel). Prints one Markdown table; the figures go in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

import msgspec
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omni_tts.engine.offline import prepare
from omni_tts.engine.talker_runner import TalkerRunner
from omni_tts.engine.talker_scheduler import TalkerRequest
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams

CHECKPOINT = Path(__file__).parent.parent / "tests" / "fixtures" / "qwen3_tts" / "tiny-custom-voice"
CASES = {"greedy": SamplingParams(temperature=0), "top-k 50": SamplingParams(temperature=0.9, top_k=50),
         "top-k off": SamplingParams(temperature=0.9, top_k=0)}


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside it, by overload."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))

    def totals(self) -> tuple[int, int]:
        """(all ops, ops that are not views)."""
        return sum(self.ops.values()), sum(n for op, n in self.ops.items() if not op.is_view)


def step_ops(tts: Qwen3TTS, num_rows: int, sampling: SamplingParams) -> OpCounter:
    """The ops of one static-shape decode of `num_rows` freshly prefilled rows sampling with `sampling`."""
    runner = TalkerRunner(tts.talker, tts.config, num_rows, 300, 64, static_shapes=True)
    requests = []
    for i in range(num_rows):
        p = prepare(tts, SynthesisRequest(text=f"Sentence {i}: the quick brown fox.", voice="ryan",
                                          sampling=msgspec.structs.replace(sampling, seed=i)))
        requests.append(TalkerRequest(str(i), p.prefill, p.trailing, p.sampling, p.max_tokens))
    runner.prefill(requests, 0)
    num_slots = max(r.prompt_len for r in requests)
    runner.decode(num_rows, num_slots)   # warm-up: lazy initialisation stays out of the count
    with torch.inference_mode(), OpCounter() as counter:
        runner.decode(num_rows, num_slots)
    return counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--checkpoint", default=str(CHECKPOINT))
    parser.add_argument("--top", type=int, default=0, help="also list the N most frequent ops of each case")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    tts = Qwen3TTS.from_pretrained(args.checkpoint)
    print(f"| sampling ({args.rows} rows) | aten ops | non-view ops |\n|---|---|---|")
    counters = {name: step_ops(tts, args.rows, sampling) for name, sampling in CASES.items()}
    for name, counter in counters.items():
        total, kernels = counter.totals()
        print(f"| {name} | {total} | {kernels} |")
    for name, counter in counters.items():
        if args.top:
            print(f"\n{name}: " + ", ".join(f"{op} {n}" for op, n in counter.ops.most_common(args.top)))


if __name__ == "__main__":
    main()
