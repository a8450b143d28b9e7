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
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "qwen3_tts"
sys.path.insert(0, str(ROOT))

from omni_tts.engine.offline import synthesize  # noqa: E402
from omni_tts.engine.talker_engine import TalkerEngine, TalkerRequest  # noqa: E402
from omni_tts.models.qwen3_tts.model import Qwen3TTS  # noqa: E402
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest  # noqa: E402
from omni_tts.models.qwen3_tts.sampling_params import SamplingParams  # noqa: E402
from omni_tts.engine.offline import prepare  # noqa: E402
from omni_tts.engine.code2wav_runner import Code2WavRunner  # noqa: E402
from omni_tts.models.qwen3_tts.lora import read_adapter  # noqa: E402
from omni_tts.models.qwen3_tts.random_model import make_random_adapter  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
results: dict = {"checks": [], "timings": {}}


def check(name: str, ok: bool, **figures) -> bool:
    results["checks"].append({"name": name, "ok": bool(ok), **figures})
    print(f"[gpu_checks] {'PASS' if ok else 'FAIL'} {name} {json.dumps(figures, default=str)}", flush=True)
    return ok


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


# --- 2. talker ----------------------------------------------------------------------------------------------------
def talker_requests(tts: Qwen3TTS, n: int, max_new_tokens: int) -> list[TalkerRequest]:
    voices = ["ryan", "vivian", "serena", "aiden", "sohee", "eric", "dylan", "uncle_fu", "ono_anna"]
    speakers = [v for v in voices if v in tts.config.talker.spk_id] or [None]
    out = []
    for i in range(n):
        p = prepare(tts, SynthesisRequest(text=f"Sentence {i}: the quick brown fox jumps over the lazy dog.",
                                          voice=speakers[i % len(speakers)],
                                          sampling=SamplingParams(temperature=0, max_new_tokens=max_new_tokens + i)))
        out.append(TalkerRequest(str(i), p.prefill, p.trailing, p.sampling, p.max_tokens))
    return out


def run_talker(engine: TalkerEngine, requests: list[TalkerRequest], stagger: int) -> dict[str, np.ndarray]:
    frames: dict[str, list] = {r.request_id: [] for r in requests}
    step = 0
    while step < stagger * len(requests) or engine.has_work():
        for i, r in enumerate(requests):
            if i * stagger == step:
                engine.add_request(TalkerRequest(r.request_id, r.prefill, r.trailing, r.sampling, r.max_tokens,
                                                 lora=r.lora))
        for out in engine.step():
            if out.frame is not None:
                frames[out.request_id].append(out.frame)
        step += 1
    return {k: np.array(v) for k, v in frames.items()}


def time_talker_steps(engine: TalkerEngine, buckets: list[int], slots: int, device: torch.device,
                      repeats: int) -> dict[int, float]:
    """ms per decode step at each batch bucket (throw-away rows; no requests are running)."""
    runner, out = engine.runner, {}
    for rows in buckets:
        runner.decode(rows, slots)
        sync(device)
        started = time.perf_counter()
        for _ in range(repeats):
            runner.decode(rows, slots)
        sync(device)
        out[rows] = (time.perf_counter() - started) / repeats * 1e3
    return out


def check_talker(tts: Qwen3TTS, label: str, device: torch.device, num_requests: int, max_new_tokens: int,
                 timing_repeats: int) -> None:
    graphs = device.type == "cuda"
    requests = talker_requests(tts, num_requests, max_new_tokens)
    longest = max(r.prompt_len + r.max_tokens for r in requests) + 1
    kwargs = dict(max_batch_size=num_requests, max_model_len=max(256, longest), max_prefill_tokens_per_step=4096,
                  max_text_tokens=512)
    started = time.perf_counter()
    fast = TalkerEngine(tts.talker, tts.config, static_shapes=True, cuda_graphs=graphs, **kwargs)
    capture_s = time.perf_counter() - started
    eager = TalkerEngine(tts.talker, tts.config, static_shapes=True, **kwargs)
    dynamic = TalkerEngine(tts.talker, tts.config, **kwargs)
    a, b, c = (run_talker(e, requests, stagger=2) for e in (fast, eager, dynamic))
    same = all(np.array_equal(a[k], b[k]) for k in a)
    check(f"talker {label}: {'graphed' if graphs else 'static'} == static eager (greedy codes)", same,
          frames=int(sum(len(v) for v in a.values())), capture_seconds=round(capture_s, 2),
          num_graphs=len(fast.runner.graphs))
    matching = [int(np.array_equal(b[k], c[k])) for k in b]
    # on CPU fp32 these are equal (tests/engine/test_talker_engine.py); other kernels at other shapes in bf16 may
    # round differently: reported, a failure only in fp32
    check(f"talker {label}: static == dynamic (greedy codes)", tts.dtype != torch.float32 or all(matching),
          requests_equal=f"{sum(matching)}/{len(matching)}")
    slots = fast.runner.slot_buckets[0]
    buckets = fast.runner.batch_buckets
    results["timings"][f"talker_{label}_step_ms"] = {
        "slots": slots,
        "graphed" if graphs else "static": time_talker_steps(fast, buckets, slots, device, timing_repeats),
        "eager": time_talker_steps(eager, buckets, slots, device, timing_repeats)}
    print(f"[gpu_checks] talker {label} step ms: {json.dumps(results['timings'][f'talker_{label}_step_ms'])}",
          flush=True)
    profile(lambda: eager.runner.decode(buckets[-1], slots), f"talker {label} eager step, {buckets[-1]} rows", device)
    check_prefill(tts, label, device, requests, fast, eager, dynamic, timing_repeats)


def check_prefill(tts: Qwen3TTS, label: str, device: torch.device, requests: list[TalkerRequest], fast: TalkerEngine,
                  eager: TalkerEngine, dynamic: TalkerEngine, timing_repeats: int) -> None:
    """The admission's prefill, paid by the new request's first audio and every running stream: the graphed (CUDA)
    or static eager (CPU) prefill's first codes == the static eager / dynamic one's, and its time at 1 and all the
    requests, graphed and eager; on CUDA its kernel count and that it makes no host sync."""
    graphs = device.type == "cuda"
    kind = "graphed" if graphs else "static"
    first = {}
    for name, engine in ((kind, fast), ("static eager", eager), ("dynamic", dynamic)):
        engine.runner.prefill(requests, 1)   # rows 1.. are throw-away here: nothing runs
        first[name] = engine.runner.c0[1:1 + len(requests)].cpu().numpy()
    check(f"talker {label}: {kind} prefill == static eager prefill (greedy first codes)",
          np.array_equal(first[kind], first["static eager"]), prompt_rows=[r.prompt_len for r in requests])
    # the dynamic prefill pads to the longest prompt, not a bucket: other shapes, which in bf16 may round
    # differently; a failure only in fp32
    same = np.array_equal(first[kind], first["dynamic"])
    check(f"talker {label}: {kind} prefill == dynamic prefill (greedy first codes)",
          tts.dtype != torch.float32 or same, equal=bool(same))
    timings: dict = {"prompt_rows": [r.prompt_len for r in requests]}
    for name, engine in ((kind, fast), ("static_eager", eager), ("eager", dynamic)):
        timings[name] = {}
        for count in (1, len(requests)):
            prefill = lambda: engine.runner.prefill(requests[:count], 0)  # noqa: E731
            prefill()
            sync(device)
            started = time.perf_counter()
            for _ in range(timing_repeats):
                prefill()
            sync(device)
            timings[name][count] = round((time.perf_counter() - started) / timing_repeats * 1e3, 3)
    timings["by_requests"] = timings["eager"]   # the dynamic eager prefill, under its earlier name
    results["timings"][f"talker_{label}_prefill_ms"] = timings
    print(f"[gpu_checks] talker {label} prefill ms by requests: {json.dumps(timings)}", flush=True)
    profile(lambda: dynamic.runner.prefill(requests[:1], 0), f"talker {label} eager prefill, 1 request", device)
    profile(lambda: fast.runner.prefill(requests[:1], 0), f"talker {label} {kind} prefill, 1 request", device)
    if graphs:   # a pageable host→device copy (or any sync) would wait for every step queued on the stream
        voice = next(iter(sorted(tts.config.talker.spk_id)), None)
        tts_request = SynthesisRequest(text="No stall, please.", voice=voice, sampling=SamplingParams(temperature=0))
        error = None
        try:
            torch.cuda.set_sync_debug_mode("error")
            p = prepare(tts, tts_request)
            fast.runner.prefill([TalkerRequest("sync", p.prefill, p.trailing, p.sampling, p.max_tokens)], 0)
        except RuntimeError as e:
            error = str(e).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        check(f"talker {label}: embed_prompt + graphed prefill make no host sync", error is None, error=error)


def check_talker_lora(tts: Qwen3TTS, label: str, device: torch.device, num_requests: int,
                      max_new_tokens: int) -> None:
    graphs = device.type == "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        adapters = {name: read_adapter(make_random_adapter(f"{tmp}/{name}", tts.model_dir, seed=seed),
                                       tts.config.talker, 16) for seed, name in ((1, "one"), (2, "two"))}
    requests = talker_requests(tts, num_requests, max_new_tokens)
    for i, request in enumerate(requests):
        request.lora = (None, "one", "two")[i % 3]
    longest = max(r.prompt_len + r.max_tokens for r in requests) + 1
    kwargs = dict(max_batch_size=num_requests, max_model_len=max(256, longest), max_prefill_tokens_per_step=4096,
                  max_text_tokens=512, max_loras=2)
    graphed = TalkerEngine(tts.talker, tts.config, static_shapes=True, cuda_graphs=graphs, **kwargs)   # empty slots
    eager = TalkerEngine(tts.talker, tts.config, static_shapes=graphs, **kwargs)   # on the CPU: the dynamic step
    for engine in (graphed, eager):
        for name, adapter in adapters.items():
            engine.load_lora(name, adapter)
    a, b = run_talker(graphed, requests, stagger=2), run_talker(eager, requests, stagger=2)
    matching = [int(np.array_equal(a[k], b[k])) for k in a]
    # on the CPU static and dynamic shapes differ, which in bf16 may round differently: a failure only in fp32
    check(f"talker {label} LoRA rows: " + ("graphed, adapters loaded after capture == static eager" if graphs else
                                          "static == dynamic") + " (greedy codes)",
          (not graphs and tts.dtype != torch.float32) or all(matching),
          frames=int(sum(len(v) for v in a.values())), requests_equal=f"{sum(matching)}/{len(matching)}")


def profile(run, label: str, device: torch.device) -> None:
    """Where one call's device time goes: kernels launched and the top ones by time (CUDA only)."""
    if device.type != "cuda":
        return
    from torch.profiler import ProfilerActivity, profile as torch_profile
    run()
    sync(device)
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        sync(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_ms = sum(e.device_time for e in kernels) / 1e3
    results["timings"][f"profile {label}"] = {"kernels": len(kernels), "kernel_ms": round(device_ms, 3)}
    print(f"[gpu_checks] profile {label}: {len(kernels)} kernels, {device_ms:.2f} ms of kernel time", flush=True)
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70),
          flush=True)


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
    check_decoder(tiny, "tiny", device, args.repeats)
    if args.model:
        started = time.perf_counter()
        big = Qwen3TTS.from_pretrained(args.model, device=device, dtype=DTYPES[args.dtype])
        results["timings"]["load_seconds"] = round(time.perf_counter() - started, 1)
        label = os.path.basename(args.model.rstrip("/"))
        check_talker(big, label, device, args.requests, args.max_new_tokens, args.repeats)
        check_talker_lora(big, label, device, args.requests, args.max_new_tokens)
        check_decoder(big, label, device, args.repeats)
    check_layouts(device)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "checks.json").write_text(json.dumps(results, indent=1, default=str))
    failed = [c["name"] for c in results["checks"] if not c["ok"]]
    print(f"[gpu_checks] {len(results['checks']) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
