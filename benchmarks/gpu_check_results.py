"""What gpu_checks.py and its parts record: one check or figure at a time, into one `results` (written to
checks.json by gpu_checks.py), and a profile of one call's kernels."""
from __future__ import annotations

import json

import torch

results: dict = {"checks": [], "timings": {}}


def check(name: str, ok: bool, **figures) -> bool:
    results["checks"].append({"name": name, "ok": bool(ok), **figures})
    print(f"[gpu_checks] {'PASS' if ok else 'FAIL'} {name} {json.dumps(figures, default=str)}", flush=True)
    return ok


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
