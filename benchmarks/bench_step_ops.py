"""How many aten ops one static-shape talker step runs on the CPU: what a CUDA graph of it replays as kernels.

    PYTHONPATH=$PWD python benchmarks/bench_step_ops.py [--rows 8] [--checkpoint DIR] [--top N]
        [--dtype bfloat16] [--fused]

The checkpoint defaults to the tiny fixture. For each sampling case (greedy; top-k 50, the checkpoints' default,
which the candidates path serves; top-k off, which needs the sorted vocabulary too) it prefills `rows` requests and
counts the ops of one `decode` with static_shapes=True (the eager twin of the captured step), all ops and those that
are not views (a view launches no kernel). --dtype bfloat16 counts what a GPU's bf16 step runs (the plain bf16
RMSNorm is 8 ops where fp32's is one). --fused runs the layers on the fused Triton kernels (in Triton's interpreter
here) and counts each launch as one op; "kernels" = non-view ops + fused launches. Prints one Markdown table; the
figures go in docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
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
from omni_tts.models.qwen3_tts.talker import import_fused_kernels

CHECKPOINT = Path(__file__).parent.parent / "tests" / "fixtures" / "qwen3_tts" / "tiny-custom-voice"
CASES = {"greedy": SamplingParams(temperature=0), "top-k 50": SamplingParams(temperature=0.9, top_k=50),
         "top-k off": SamplingParams(temperature=0.9, top_k=0)}


FUSED = ("add_rms_norm", "qk_norm_rope", "attention", "silu_mul", "sample_candidates")   # fused_kernels' launchers, one kernel each


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside it, by overload, and the fused kernels' launches (`fused`, by name;
    the aten ops Triton's interpreter runs inside a launch are not the kernel's and are not counted)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.fused: Counter = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops[func] += 1
        return func(*args, **(kwargs or {}))

    def totals(self) -> tuple[int, int]:
        """(all ops, ops that are not views + fused launches: the kernels)."""
        return sum(self.ops.values()), sum(n for op, n in self.ops.items() if not op.is_view) + self.total_fused()

    def total_fused(self) -> int:
        return sum(self.fused.values())

    @contextlib.contextmanager
    def counting_fused(self, kernels):
        """Within it, count the launches of the fused_kernels module `kernels` (its launchers wrapped, then put back)."""
        launchers = {name: getattr(kernels, name) for name in FUSED}

        def counted(*args, _name: str):
            self.fused[_name] += 1
            self.paused, paused = True, self.paused
            try:
                return launchers[_name](*args)
            finally:
                self.paused = paused
        for name in FUSED:
            setattr(kernels, name, functools.partial(counted, _name=name))
        try:
            yield self
        finally:
            for name, launch in launchers.items():
                setattr(kernels, name, launch)


def step_ops(tts: Qwen3TTS, num_rows: int, sampling: SamplingParams, kernels=None) -> OpCounter:
    """The ops of one static-shape decode of `num_rows` freshly prefilled rows sampling with `sampling`; kernels: the
    fused_kernels module the layers run on (None: the plain ops)."""
    runner = TalkerRunner(tts.talker, tts.config, num_rows, 300, 64, static_shapes=True)
    requests = []
    for i in range(num_rows):
        p = prepare(tts, SynthesisRequest(text=f"Sentence {i}: the quick brown fox.", voice="ryan",
                                          sampling=msgspec.structs.replace(sampling, seed=i)))
        requests.append(TalkerRequest(str(i), p.prefill, p.trailing, p.sampling, p.max_tokens))
    runner.prefill(requests, 0)
    num_slots = max(r.prompt_len for r in requests)
    runner.decode(num_rows, num_slots)   # warm-up: lazy initialisation stays out of the count
    counter = OpCounter()
    with torch.inference_mode(), counter, counter.counting_fused(kernels) if kernels else contextlib.nullcontext():
        runner.decode(num_rows, num_slots)
    return counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--checkpoint", default=str(CHECKPOINT))
    parser.add_argument("--top", type=int, default=0, help="also list the N most frequent ops of each case")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--fused", action="store_true", help="the layers on the fused kernels (Triton's interpreter)")
    args = parser.parse_args()
    if args.fused:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype)
    tts = Qwen3TTS.from_pretrained(args.checkpoint, dtype=dtype)
    kernels = None
    if args.fused:
        kernels = import_fused_kernels(dtype)
        assert kernels is not None, "the fused kernels need Triton"
        tts.talker.use_fused_kernels(kernels)
    print(f"| sampling ({args.rows} rows, {args.dtype}{', fused' if args.fused else ''}) | aten ops | kernels "
          f"(non-view ops + fused launches) | fused launches |\n|---|---|---|---|")
    counters = {name: step_ops(tts, args.rows, sampling, kernels) for name, sampling in CASES.items()}
    for name, counter in counters.items():
        total, launched = counter.totals()
        print(f"| {name} | {total} | {launched} | {counter.total_fused()} |")
    for name, counter in counters.items():
        if args.top:
            print(f"\n{name}: " + ", ".join(f"{op} {n}" for op, n in counter.ops.most_common(args.top)))


if __name__ == "__main__":
    main()
