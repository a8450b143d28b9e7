"""The cost of LoRA rows in the talker's decode step: time and memory, without adapters and with N of them.

    PYTHONPATH=$PWD python benchmarks/lora_step.py [--checkpoint DIR] [--rows 8] [--loras 4] [--rank 16]
                                                   [--device cpu|cuda] [--dtype float32] [--steps 30]

Cases, each over `rows` freshly prefilled greedy rows: `off` (max_loras 0: the plain step), `base rows` (max_loras N,
every row without an adapter: the price of having slots), `adapter rows` (every row on one of N adapters, round
robin), `mix` (half the rows without). Each times `steps` decode steps after warm-up (the median; on CUDA the step
replays its CUDA graph, on the CPU it runs eagerly) and counts the step's non-view aten ops (bench_step_ops.py).
Memory: the slots' buffers (every target linear's A and B for N adapters at rank `rank`, and the masks). The
adapters are random (`make_random_adapter`) of rank `rank`. Prints one Markdown table for docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench_step_ops import OpCounter
from omni_tts.engine.offline import prepare
from omni_tts.engine.talker_runner import TalkerRunner
from omni_tts.engine.talker_scheduler import TalkerRequest
from omni_tts.models.qwen3_tts.lora import read_adapter
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.random_model import make_random_adapter
from omni_tts.models.qwen3_tts.sampling import SamplingParams

CHECKPOINT = Path(__file__).parent.parent / "tests" / "fixtures" / "qwen3_tts" / "tiny-custom-voice"


def runner_for(tts: Qwen3TTS, rows: int, steps: int, adapters: list, slots: list[int], cuda: bool
               ) -> tuple[TalkerRunner, int]:
    """A runner with `rows` prefilled rows, row i on adapter slot slots[i]; and the attention slots its steps need."""
    requests = []
    for i in range(rows):
        p = prepare(tts, SynthesisRequest(text=f"Sentence {i}: the quick brown fox jumps over the lazy dog.",
                                          voice="ryan", sampling=SamplingParams(temperature=0)))
        requests.append(TalkerRequest(str(i), p.prefill, p.trailing, p.sampling, p.max_tokens, lora_slot=slots[i]))
    num_slots = max(r.prompt_len for r in requests) + steps + 8
    runner = TalkerRunner(tts.talker, tts.config, rows, num_slots, 64, static_shapes=cuda, cuda_graphs=cuda,
                          max_loras=len(adapters), max_lora_rank=max((a.rank for a in adapters), default=1))
    for slot, adapter in enumerate(adapters, 1):
        runner.lora.load(slot, adapter)
    runner.prefill(requests, 0)
    return runner, num_slots


def step_seconds(runners: list[tuple[TalkerRunner, int]], rows: int, steps: int) -> list[list[float]]:
    """Each runner's step times, the runners taking turns step by step: a neighbour's load on a shared machine
    falls on every case alike."""
    for runner, num_slots in runners:
        for _ in range(3):
            runner.decode(rows, num_slots)   # warm-up
    times: list[list[float]] = [[] for _ in runners]
    for _ in range(steps):
        for i, (runner, num_slots) in enumerate(runners):
            start = time.perf_counter()
            runner.decode(rows, num_slots)   # its one D2H copy waits for the step
            times[i].append(time.perf_counter() - start)
    return times


def step_ops(runner: TalkerRunner, rows: int, num_slots: int) -> int | None:
    """Non-view ops of one step (None for a replayed CUDA graph: it dispatches no aten op)."""
    if runner.cuda_graphs:
        return None
    with torch.inference_mode(), OpCounter() as counter:
        runner.decode(rows, num_slots)
    return counter.totals()[1]


def slot_bytes(runner: TalkerRunner) -> int:
    lora = runner.lora
    if lora is None:
        return 0
    tensors = [t for pair in lora.buffers.values() for t in pair] + list(lora.masks.values())   # A: views, disjoint
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=str(CHECKPOINT))
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--loras", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (a CPU stage's default on 2 cores)")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    tts = Qwen3TTS.from_pretrained(args.checkpoint, device=args.device, dtype=getattr(torch, args.dtype))
    cuda = tts.device.type == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [read_adapter(make_random_adapter(f"{tmp}/a{i}", args.checkpoint, seed=i, rank=args.rank),
                                 tts.config.talker, args.rank) for i in range(args.loras)]
    on_adapters = [1 + i % args.loras for i in range(args.rows)]
    cases = {"off (max_loras 0)": ([], [0] * args.rows),
             f"base rows (max_loras {args.loras})": (adapters, [0] * args.rows),
             f"adapter rows ({args.loras} adapters)": (adapters, on_adapters),
             "mix (half the rows without)": (adapters, [s if i % 2 else 0 for i, s in enumerate(on_adapters)])}
    print(f"{args.checkpoint}, {args.device} {args.dtype}, {args.rows} rows, rank {args.rank}, "
          f"{'CUDA graphs' if cuda else 'eager'}\n")
    runners = [runner_for(tts, args.rows, args.steps, loaded, slots, cuda) for loaded, slots in cases.values()]
    medians = [1000 * statistics.median(t) for t in step_seconds(runners, args.rows, args.steps)]
    print("| case | step ms (median) | ÷ off | non-view ops | slot buffers MiB |\n|---|---:|---:|---:|---:|")
    for name, (runner, num_slots), ms in zip(cases, runners, medians):
        ops = step_ops(runner, args.rows, num_slots)
        print(f"| {name} | {ms:.2f} | {ms / medians[0]:.2f} | {'graph' if ops is None else ops} | "
              f"{slot_bytes(runner) / 2 ** 20:.2f} |")


if __name__ == "__main__":
    main()
