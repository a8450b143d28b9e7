"""Correctness on a device before any speed figure (the first part of `gpu_first_run.sh`).

    python benchmarks/gpu_checks.py --device cuda --out RESULT_DIR     # on a GPU
    python benchmarks/gpu_checks.py --device cpu --out RESULT_DIR      # the same checks on the CPU

1. goldens: every golden case of tests/fixtures/qwen3_tts through `synthesize` in fp32 on the device (TF32 off):
   codes identical to the reference's, audio within the fixture README's 1e-4.
2. talker: the graph-captured step (CUDA) or the static-shape eager step (CPU) against the eager step, on the tiny
   fixture and a real-size random checkpoint (--preset) in --dtype: identical greedy codes, requests joining and
   finishing mid-run; the time of one decode step per batch bucket, eager and graphed. The prefill: graphed (CUDA)
   or static eager (CPU) against the static eager and the dynamic one (greedy first codes), its time at 1 and all
   the requests graphed, static eager and eager, its kernels, and (CUDA) no host sync in embed_prompt + prefill.
   The fused kernels (CUDA, fused_kernels.py: what the talker stage runs): the graphed step on them against the
   plain eager step (greedy codes equal in fp32, reported in bf16), its time per bucket, its kernels a step.
   (The talker's checks: gpu_talker_checks.py.)
3. decoder: one pass == streamed; the static-shape runner (graph-captured on CUDA) against the dynamic one, first
   and steady chunks at 1-64 rows and 1/4/7/25 frames: max |difference| within the dtype's tolerance; and the time
   of one decoder call (slots in, audio on the host) per (rows, frames), graphed and eager.
   LoRA rows: two random adapters loaded after the graphs were captured (copied into their slots, no recapture),
   rows on each and on none in one batch (the first steps, on the base model alone, replay the graphs without
   adapters): the graphed step's greedy codes == the static eager step's (on the CPU: the static step's == the
   dynamic step's).
4. layouts: the tiny fixture served on the device (fp32) by both stage processes (connector shm) and by the fused
   layout (one process, connector local): the same greedy audio (the golden's difference reported beside it).
Writes checks.json (every figure) and prints one line per check; exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "qwen3_tts"
sys.path.insert(0, str(ROOT))

from gpu_check_results import check, profile, results  # noqa: E402
from gpu_talker_checks import check_fused_kernels, check_talker, check_talker_lora  # noqa: E402
from omni_tts.engine.code2wav_runner import Code2WavRunner  # noqa: E402
from omni_tts.engine.offline import synthesize  # noqa: E402
from omni_tts.models.qwen3_tts.model import Qwen3TTS  # noqa: E402
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest  # noqa: E402
from omni_tts.models.qwen3_tts.sampling_params import SamplingParams  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --- 1. goldens ---------------------------------------------------------------------------------------------------
def golden_requests(case: dict) -> list[SynthesisRequest]:
    params = case["params"]
    n = len(params["text"]) if isinstance(params["text"], list) else 1
    rows = [{k: (v[i] if isinstance(v, list) else v) for k, v in params.items()} for i in range(n)]
    return [SynthesisRequest(
        text=r["text"], voice=r.get("speaker"), language=r.get("language"), instructions=r.get("instruct"),
        ref_audio=str(FIXTURES / r["ref_audio"]) if r.get("ref_audio") else None, ref_text=r.get("ref_text"),
        x_vector_only=bool(r.get("x_vector_only_mode", False)), non_streaming_mode=r.get("non_streaming_mode"),
        sampling=SamplingParams(temperature=0, max_new_tokens=r["max_new_tokens"])) for r in rows]


def check_goldens(device: torch.device) -> None:
    from safetensors.numpy import load_file
    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    models: dict[str, Qwen3TTS] = {}
    for case in (c for c in manifest["cases"] if c.get("params")):
        variant = case["variant"]
        if variant not in models:
            models[variant] = Qwen3TTS.from_pretrained(str(FIXTURES / variant), device=device, dtype=torch.float32)
        arrays = load_file(str(FIXTURES / case["file"]))
        out = synthesize(models[variant], golden_requests(case))
        codes_equal = all(np.array_equal(r.codes, arrays[f"codes_{i}"]) for i, r in enumerate(out))
        wav_diff = max(float(np.abs(r.audio - arrays[f"wav_{i}"]).max()) if r.audio.shape == arrays[f"wav_{i}"].shape
                       else float("inf") for i, r in enumerate(out))
        check(f"golden {case['name']}", codes_equal and wav_diff <= 1e-4, codes_equal=codes_equal,
              max_wav_diff=wav_diff)


# --- 3. decoder ---------------------------------------------------------------------------------------------------
def check_decoder(tts: Qwen3TTS, label: str, device: torch.device, timing_repeats: int) -> None:
    decoder = tts.decoder
    tolerance = 1e-5 if tts.dtype == torch.float32 else 2e-2   # bf16: a few units in the last place of ~0.5
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, decoder.cfg.codebook_size, (2, decoder.cfg.num_quantizers, 40), generator=gen)
    whole = decoder(codes.to(device))
    streamed = decoder(codes.to(device), chunk_frames=7)
    diff = float((whole.float() - streamed.float()).abs().max())
    check(f"decoder {label}: streamed (7-frame chunks) == one pass", diff <= tolerance, max_diff=diff)

    graphs = device.type == "cuda"
    started = time.perf_counter()
    fast = Code2WavRunner(decoder, 64, static_shapes=True, cuda_graphs=graphs)
    capture_s = time.perf_counter() - started
    dynamic = Code2WavRunner(decoder, 64)
    worst = 0.0
    for rows in (1, 3, 16, 64):
        for frames in (1, 4, 7, 25):   # 7: split into captured sizes 6 + 1
            audio = []
            for runner in (fast, dynamic):
                slots = [runner.allocate() for _ in range(rows)]
                chunk = np.random.default_rng(rows * 100 + frames).integers(
                    0, decoder.cfg.codebook_size, (rows, 2 * frames, decoder.cfg.num_quantizers))
                first = runner.decode(slots, chunk[:, :frames])     # first chunks: fresh state
                steady = runner.decode(slots, chunk[:, frames:])    # steady chunks: carried state
                audio.append(np.concatenate([first, steady], axis=1))
                for slot in slots:
                    runner.release(slot)
            worst = max(worst, float(np.abs(audio[0] - audio[1]).max()))
    check(f"decoder {label}: {'graphed' if graphs else 'static'} == dynamic (first and steady chunks, rows 1-64, "
          "frames 1/4/7/25)", worst <= tolerance, max_diff=worst, capture_seconds=round(capture_s, 2),
          num_graphs=len(fast.graphs))
    timings = {}
    for kind, runner in (("graphed" if graphs else "static", fast), ("eager", dynamic)):
        timings[kind] = {}
        for rows in (1, 4, 16, 64):
            for frames in (1, 4, 25):
                slots = [runner.allocate() for _ in range(rows)]
                chunk = np.zeros((rows, frames, decoder.cfg.num_quantizers), dtype=np.int64)
                runner.decode(slots, chunk)
                started = time.perf_counter()
                for _ in range(timing_repeats):
                    runner.decode(slots, chunk)
                timings[kind][f"{rows}x{frames}"] = round((time.perf_counter() - started) / timing_repeats * 1e3, 3)
                if (rows, frames) == (16, 4) and kind == "eager":
                    profile(lambda: runner.decode(slots, chunk), f"decoder {label} 16x4", device)
                for slot in slots:
                    runner.release(slot)
    results["timings"][f"decoder_{label}_call_ms"] = timings
    print(f"[gpu_checks] decoder {label} call ms (rows x frames): {json.dumps(timings)}", flush=True)


# --- 4. layouts ---------------------------------------------------------------------------------------------------
def check_layouts(device: torch.device) -> None:
    import asyncio

    import msgspec

    from omni_tts.config import load_stage_config, stage_config_from_dict
    from omni_tts.orchestrator.async_tts import AsyncTTS
    from safetensors.numpy import load_file

    manifest = json.loads((FIXTURES / "manifest.json").read_text())
    case = next(c for c in manifest["cases"] if c.get("params") and c["variant"] == "tiny-custom-voice")
    requests, golden = golden_requests(case), load_file(str(FIXTURES / case["file"]))

    async def serve(pipeline) -> list[np.ndarray]:
        async with AsyncTTS(str(FIXTURES / "tiny-custom-voice"), pipeline) as engine:
            async def one(request: SynthesisRequest) -> np.ndarray:
                return np.concatenate([chunk.audio async for chunk in engine.generate(request)])
            return await asyncio.gather(*(one(r) for r in requests))

    audio = {}
    for kind in ("shm", "local"):
        data = msgspec.to_builtins(load_stage_config("cpu_tiny"))
        for stage in data["stages"].values():
            stage["device"] = str(device)
        data["connector"]["kind"] = kind
        started = time.perf_counter()
        audio[kind] = asyncio.run(serve(stage_config_from_dict(data, f"cpu_tiny on {device}, connector {kind}")))
        results["timings"][f"layout_{kind}_seconds"] = round(time.perf_counter() - started, 1)
    same_shapes = all(a.shape == b.shape for a, b in zip(audio["shm"], audio["local"]))
    diff = max(float(np.abs(a - b).max()) for a, b in zip(audio["shm"], audio["local"])) if same_shapes else None
    golden_diff = max((float(np.abs(a - golden[f"wav_{i}"]).max()) for i, a in enumerate(audio["local"])
                       if a.shape == golden[f"wav_{i}"].shape), default=None)
    check("layouts: fused (one process) == two processes (served greedy audio, tiny fp32)",
          same_shapes and diff <= 1e-5, max_diff=diff, golden_max_diff=golden_diff)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", help="a real-size checkpoint folder (omni-tts make-tiny-model --preset ...)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_grad_enabled(False)
    results["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results["torch"] = torch.__version__
    started = time.perf_counter()
    check_goldens(device)
    results["timings"]["goldens_seconds"] = round(time.perf_counter() - started, 1)
    tiny = Qwen3TTS.from_pretrained(str(FIXTURES / "tiny-custom-voice"), device=device, dtype=DTYPES[args.dtype])
    check_talker(tiny, "tiny", device, args.requests, args.max_new_tokens, args.repeats)
    check_talker_lora(tiny, "tiny", device, args.requests, args.max_new_tokens)
    check_fused_kernels(tiny, "tiny", device, args.requests, args.max_new_tokens, args.repeats)
    check_decoder(tiny, "tiny", device, args.repeats)
    if args.model:
        started = time.perf_counter()
        big = Qwen3TTS.from_pretrained(args.model, device=device, dtype=DTYPES[args.dtype])
        results["timings"]["load_seconds"] = round(time.perf_counter() - started, 1)
        label = os.path.basename(args.model.rstrip("/"))
        check_talker(big, label, device, args.requests, args.max_new_tokens, args.repeats)
        check_talker_lora(big, label, device, args.requests, args.max_new_tokens)
        check_fused_kernels(big, label, device, args.requests, args.max_new_tokens, args.repeats)
        check_decoder(big, label, device, args.repeats)
    check_layouts(device)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "checks.json").write_text(json.dumps(results, indent=1, default=str))
    failed = [c["name"] for c in results["checks"] if not c["ok"]]
    print(f"[gpu_checks] {len(results['checks']) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
