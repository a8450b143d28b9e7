"""gpu_checks.py's talker part: the graphed step and prefill against the eager ones, LoRA rows, the fused kernels;
step and prefill times and kernel counts (the module doc of gpu_checks.py lists the checks)."""
from __future__ import annotations

import json
import tempfile
import time

import numpy as np
import torch

from gpu_check_results import check, profile, results, sync
from omni_tts.engine.offline import prepare
from omni_tts.engine.talker_engine import TalkerEngine, TalkerRequest
from omni_tts.models.qwen3_tts.lora import read_adapter
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.random_model import make_random_adapter
from omni_tts.models.qwen3_tts.sampling_params import SamplingParams


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


def check_fused_kernels(tts: Qwen3TTS, label: str, device: torch.device, num_requests: int, max_new_tokens: int,
                        timing_repeats: int) -> None:
    """The serving path's fused kernels (CUDA; the CPU tests them in Triton's interpreter,
    tests/models/test_fused_kernels.py): compiled, at this model's shapes and dtype, the graphed step on them against
    the plain eager step (greedy codes: equal in fp32; bf16 attention rounds elsewhere than SDPA: reported), its
    time per batch bucket beside the plain step's, and its kernels (the profile of the eager step on them)."""
    if device.type != "cuda":
        return
    from omni_tts.models.qwen3_tts.talker import import_fused_kernels
    kernels = import_fused_kernels(tts.dtype)
    if not check(f"fused kernels {label}: Triton imports and takes {tts.dtype}", kernels is not None):
        return
    requests = talker_requests(tts, num_requests, max_new_tokens)
    longest = max(r.prompt_len + r.max_tokens for r in requests) + 1
    kwargs = dict(max_batch_size=num_requests, max_model_len=max(256, longest), max_prefill_tokens_per_step=4096,
                  max_text_tokens=512)
    plain = TalkerEngine(tts.talker, tts.config, static_shapes=True, **kwargs)
    tts.talker.use_fused_kernels(kernels)
    try:
        started = time.perf_counter()
        fused = TalkerEngine(tts.talker, tts.config, static_shapes=True, cuda_graphs=True, **kwargs)
        capture_s = time.perf_counter() - started
        fused_eager = TalkerEngine(tts.talker, tts.config, static_shapes=True, **kwargs)
        tts.talker.use_fused_kernels(None)
        expected = run_talker(plain, requests, stagger=2)
        tts.talker.use_fused_kernels(kernels)
        got = run_talker(fused, requests, stagger=2)
        matching = [int(np.array_equal(got[k], expected[k])) for k in got]
        check(f"talker {label}: graphed on the fused kernels == plain static eager (greedy codes)",
              tts.dtype != torch.float32 or all(matching), requests_equal=f"{sum(matching)}/{len(matching)}",
              capture_seconds=round(capture_s, 2))
        slots, buckets = fused.runner.slot_buckets[0], fused.runner.batch_buckets
        steps = results["timings"].setdefault(f"talker_{label}_step_ms", {"slots": slots})
        steps["graphed, fused kernels"] = time_talker_steps(fused, buckets, slots, device, timing_repeats)
        print(f"[gpu_checks] talker {label} step ms: {json.dumps(steps)}", flush=True)
        profile(lambda: fused_eager.runner.decode(buckets[-1], slots),
                f"talker {label} eager step on the fused kernels, {buckets[-1]} rows", device)
        profile(lambda: fused_eager.runner.decode(1, slots), f"talker {label} eager step on the fused kernels, 1 row",
                device)
    except Exception as e:   # a kernel this device cannot compile: a failed check, and the other checks go on
        check(f"talker {label}: the fused kernels compile and run", False, error=repr(e)[:500])
    finally:
        tts.talker.use_fused_kernels(None)
