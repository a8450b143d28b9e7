"""`omni-tts serve-ray`: the HTTP API of `omni-tts serve`, the same aiohttp app (api/app.py) in this process, in
front of Ray Serve replicas of the pipeline (orchestrator/ray_replica.py) instead of one pipeline of its own.

Ray Serve's HTTP proxy is not used (aiohttp is no ASGI app, and one front end keeps every route, body, stream and
error literally the code `serve` runs): the app calls the replicas through a DeploymentHandle
(orchestrator/ray_tts.py). Uploaded voices live in this process's store and travel inside each request, so
every replica can use them. Joins the Ray cluster at $RAY_ADDRESS, else starts a local Ray instance with this
machine's cores and GPUs, and ends it on exit.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable

from omni_tts import package_version
from omni_tts.config import available_cpus, stage_threads
from omni_tts.config.options import from_options
from omni_tts.config.settings import SupervisionSettings
from omni_tts.entrypoints.cli.serve import (listener_url, load_checkpoint, quoted_names, server_config,
                                            with_random_weights_note)

if TYPE_CHECKING:
    from omni_tts.audio.url_fetch import UrlPolicy
    from omni_tts.config import PipelineConfig
    from omni_tts.entrypoints.api.socket_server import Loaded

logger = logging.getLogger(__name__)
DEPLOYMENT = "PipelineReplica"
# Ray replaces a replica after three failed checks in a row: 15 s, longer than a pipeline takes to restart its own
# stages after one failed (docs/reliability.md), so only a replica that cannot heal itself is replaced
HEALTH_CHECK_PERIOD_S = 5.0
HEALTH_CHECK_TIMEOUT_S = 10.0   # a replica whose event loop is stuck this long fails the check


def check_arguments(args: argparse.Namespace) -> None:
    """ValueError for replica options that cannot go together, or that replicas do not take."""
    if len(args.models) > 1 or args.idle_unload is not None or args.lora or args.lora_dir:
        raise ValueError("serve-ray serves one model per replica (no --model twice, --models, --idle-unload or LoRA "
                         "adapters); serve several models and adapters with `omni-tts serve`")
    autoscaling = args.min_replicas is not None or args.max_replicas is not None
    if args.replicas is not None and autoscaling:
        raise ValueError("--replicas fixes the number of replicas; leave it out to autoscale between --min-replicas "
                         "and --max-replicas")
    if args.replicas is not None and args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    low, high = replica_bounds(args)
    if low < 1 or high < low:  # with none running, the front end answers 503 and Ray would see no load to scale on
        raise ValueError(f"--min-replicas must be >= 1 and --max-replicas >= --min-replicas, got {low} and {high}")
    if not args.target_ongoing_requests > 0:
        raise ValueError(f"--target-ongoing-requests must be > 0, got {args.target_ongoing_requests}")
    if not args.cpus_per_replica > 0:
        raise ValueError(f"--cpus-per-replica must be > 0, got {args.cpus_per_replica}")
    if args.gpus_per_replica is not None and args.gpus_per_replica < 0:
        raise ValueError(f"--gpus-per-replica must be >= 0, got {args.gpus_per_replica}")


def replica_bounds(args: argparse.Namespace) -> tuple[int, int]:
    """The fewest and most replicas (equal for a fixed number)."""
    if args.min_replicas is None and args.max_replicas is None:
        return (args.replicas or 1,) * 2
    low = args.min_replicas if args.min_replicas is not None else 1
    return low, args.max_replicas if args.max_replicas is not None else low


def gpus_per_replica(args: argparse.Namespace, pipeline: PipelineConfig) -> float:
    if args.gpus_per_replica is not None:
        return args.gpus_per_replica
    return len({cfg.device for cfg in pipeline.stages.by_name().values() if cfg.device.startswith("cuda")})


@contextlib.contextmanager
def ray_replicas(listener: socket.socket, args: argparse.Namespace,
                 ref_audio_urls: UrlPolicy | None) -> Iterator[Callable[[], Loaded]]:
    """`omni-tts serve-ray`'s loader (`serve.serve`): start or join Ray and deploy the replicas; Ray is shut down
    when serving ends."""
    # Serve's router picks the less loaded of two replicas, but trusts a cached queue length over probing a replica
    # whose entry went stale, so a replica that idles for the cache's lifetime gets no share of a burst: probe both
    # for every request (a round trip of a millisecond beside requests of seconds). Read when ray.serve is imported.
    os.environ.setdefault("RAY_SERVE_QUEUE_LENGTH_CACHE_TIMEOUT_S", "0")
    import ray
    from ray import serve

    from omni_tts.orchestrator.ray_tts import RayTTS
    from omni_tts.orchestrator.ray_replica import PipelineReplica

    model_dir, stage_config, pipeline, names = load_checkpoint(args)
    low, high = replica_bounds(args)
    gpus = gpus_per_replica(args, pipeline)
    joining = bool(os.environ.get("RAY_ADDRESS"))
    if not joining:
        _check_local_resources(low, args.cpus_per_replica, gpus)
    url = listener_url(listener)
    app_name = args.app_name or f"omni-tts-{socket.gethostname()}-{listener.getsockname()[1]}"
    scaling = ({"num_replicas": low} if low == high else
               {"autoscaling_config": {"min_replicas": low, "max_replicas": high,
                                       "target_ongoing_requests": args.target_ongoing_requests}})
    replica = serve.deployment(
        PipelineReplica, name=DEPLOYMENT, ray_actor_options={"num_cpus": args.cpus_per_replica, "num_gpus": gpus},
        # admission (--max-queue) happens in this process: Serve queues nothing of its own
        max_ongoing_requests=args.max_queue,
        health_check_period_s=HEALTH_CHECK_PERIOD_S, health_check_timeout_s=HEALTH_CHECK_TIMEOUT_S,
        logging_config={"enable_access_log": False},  # this process logs each request
        **scaling)
    cores = max(1, int(args.cpus_per_replica))
    app = replica.bind(args.model, pipeline, cores, from_options(SupervisionSettings, args))
    if joining:
        ray.init(logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=available_cpus(), include_dashboard=False, logging_level=logging.WARNING)
    try:
        serve.start(proxy_location="Disabled")
        tts = RayTTS(app, app_name, DEPLOYMENT, model_dir, pipeline)
        count = f"{low} replica{'s' if low > 1 else ''}" if low == high else f"{low} to {high} replicas"
        threads = ", ".join(f"{stage} {n}" for stage, n in stage_threads(pipeline, cores).items())
        each = (f"{args.cpus_per_replica:g} CPU and {gpus:g} GPU each, stage config {stage_config}, torch threads "
                f"{threads}")
        logger.info("omni-tts %s: deploying %s of %s as Ray Serve application '%s' (%s) to serve at %s",
                    package_version(), count, model_dir, app_name, each, url)
        config = server_config(args, names, ref_audio_urls, model_dir)
        ready = with_random_weights_note(f"ready: serving {model_dir} as {quoted_names(names)} at {url} through Ray "
                                         f"Serve application '{app_name}': {count}, {each}", config.random_weights)
        yield lambda: (tts, config, ready)
    finally:
        ray.shutdown()


def _check_local_resources(replicas: int, cpus: float, gpus: float) -> None:
    """A local Ray instance has this machine's cores and GPUs: replicas that do not fit would wait forever."""
    import torch

    have_cpus, have_gpus = available_cpus(), torch.cuda.device_count()
    if replicas * cpus > have_cpus:
        raise ValueError(f"{replicas} replicas of {cpus:g} CPUs do not fit the {have_cpus} cores here; lower "
                         "--cpus-per-replica (fractions share cores)")
    if replicas * gpus > have_gpus:
        raise ValueError(f"{replicas} replicas of {gpus:g} GPUs do not fit the {have_gpus} GPUs here; lower "
                         "--gpus-per-replica (fractions share a GPU) or the replicas")
