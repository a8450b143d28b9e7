"""One streaming decoder call's cost by batch × frames, in-process, for side-by-side runs of two revisions.

    python benchmarks/bench_decoder_calls.py --model DIR [--threads 1] [--calls 15]
    PYTHONPATH=/path/to/other/checkout python benchmarks/bench_decoder_calls.py --model DIR   # the other revision

Prints one line: the median milliseconds of `SpeechDecoder.decode_chunk` for each B × F (random codes, a running
stream state, after one warm-up call), tagged with the checkout the package was imported from.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

import omni_tts
from omni_tts.config import set_torch_threads
from omni_tts.models.qwen3_tts.model import Qwen3TTS

SHAPES = [(1, 1), (1, 2), (1, 4), (1, 8), (4, 2), (16, 1), (1, 25)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint directory (e.g. make-tiny-model --preset medium)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (code2wav's budget on 2 cores is 1)")
    ap.add_argument("--calls", type=int, default=15)
    args = ap.parse_args()
    set_torch_threads(args.threads)
    decoder = Qwen3TTS(args.model, device="cpu", dtype=torch.float32).decoder
    cells = []
    with torch.inference_mode():
        for batch, frames in SHAPES:
            codes = torch.randint(0, 2048, (batch, 16, frames), generator=torch.Generator().manual_seed(0))
            state = decoder.new_stream_state(batch)
            decoder.decode_chunk(codes, state)
            samples = []
            for _ in range(args.calls):
                start = time.perf_counter()
                decoder.decode_chunk(codes, state)
                samples.append(time.perf_counter() - start)
            cells.append(f"{batch}x{frames}: {np.median(samples) * 1e3:.1f}")
    print(Path(omni_tts.__file__).parent.parent, "|", " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
