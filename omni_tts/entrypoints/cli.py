"""`omni-tts` command line: offline synthesis and random-weight checkpoints."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

import numpy as np


def _add_synthesize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synthesize", help="synthesize one utterance offline")
    p.add_argument("--model", help="checkpoint directory or Hugging Face repo id (default: the embedded tiny model)")
    p.add_argument("--text", required=True)
    p.add_argument("--task-type", choices=["CustomVoice", "VoiceDesign", "Base"])
    p.add_argument("--voice", help="CustomVoice speaker (default: the first speaker of the checkpoint)")
    p.add_argument("--language", help="e.g. English, Chinese; default Auto")
    p.add_argument("--instructions")
    p.add_argument("--ref-audio", help="reference clip for Base voice cloning")
    p.add_argument("--ref-text", help="transcript of --ref-audio (ICL cloning)")
    p.add_argument("--x-vector-only", action="store_true", help="clone from the speaker embedding only")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--non-streaming-mode", dest="non_streaming_mode", action="store_true", default=None)
    mode.add_argument("--streaming-mode", dest="non_streaming_mode", action="store_false")
    p.add_argument("--temperature", type=float, help="0 = greedy")
    p.add_argument("--top-k", type=int)
    p.add_argument("--top-p", type=float)
    p.add_argument("--repetition-penalty", type=float)
    p.add_argument("--seed", type=int)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", required=True, help="FILE.wav (16-bit PCM, 24 kHz) or FILE.npy (float32 samples)")
    p.add_argument("--codes-out", help="FILE.npy for the [T, 16] codes")


def _add_make_tiny_model(sub: argparse._SubParsersAction) -> None:
    from omni_tts.models.qwen3_tts.random_model import PRESETS, VARIANTS

    p = sub.add_parser("make-tiny-model", help="write a deterministic random-weight checkpoint (HF layout)")
    p.add_argument("out_dir")
    p.add_argument("--variant", required=True, choices=VARIANTS)
    p.add_argument("--preset", default="tiny", choices=PRESETS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="dtype of model.safetensors (the speech tokenizer is always fp32, as released)")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    p.add_argument("--model", help="checkpoint directory or Hugging Face repo id (default: the embedded tiny model)")
    p.add_argument("--stage-config", help="stage layout: a name in stage_configs/ or a YAML path "
                                          "(default: qwen3_tts_1gpu with CUDA, else cpu_tiny)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the `model` values clients send; the first is the primary, listed first in /v1/models "
                        "(default: the checkpoint folder's name)")
    p.add_argument("--no-openai-aliases", dest="openai_aliases", action="store_false",
                   help="do not also answer to OpenAI's TTS model names (tts-1, tts-1-hd, gpt-4o-mini-tts, "
                        "gpt-4o-mini-tts-2025-12-15)")
    p.add_argument("--default-voice", help="CustomVoice: the voice of requests that name none, a speaker or an "
                                           "OpenAI voice name (default: such requests are refused)")
    p.add_argument("--max-queue", type=int, default=256, help="admitted requests beyond which the server answers 429")
    p.add_argument("--voices-dir", help="where uploaded voices are kept (enables POST /v1/audio/voices)")
    p.add_argument("--allowed-local-media-path", help="directory ref_audio may name local files in")
    p.add_argument("--allow-remote-ref-audio", action="store_true",
                   help="fetch http(s) ref_audio URLs (public addresses only, unless --ref-audio-allowed-hosts)")
    p.add_argument("--ref-audio-allowed-hosts", action="append", default=[], metavar="HOST_OR_CIDR[,…]",
                   help="hosts, addresses or networks ref_audio URLs may reach although they are not public "
                        "(loopback, private, link-local); repeatable or comma-separated")
    p.add_argument("--voices-quota-mb", type=int, default=1024,
                   help="total size of the uploaded voices' clips, in MiB; uploads beyond are answered 413")
    p.add_argument("--api-key", default=os.environ.get("OMNI_TTS_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $OMNI_TTS_API_KEY)")
    p.add_argument("--body-read-timeout", type=float, default=30.0,
                   help="seconds a request body may take to arrive before the server answers 408")
    p.add_argument("--first-audio-timeout", type=float, default=120.0,
                   help="seconds an admitted request may wait for its first audio before a 503")
    p.add_argument("--request-timeout", type=float, default=1800.0,
                   help="seconds a request may run before it is ended (504, or a cut stream)")
    p.add_argument("--stage-heartbeat-timeout", type=float, default=5.0,
                   help="seconds without a heartbeat before a stage counts as hung and the pipeline restarts")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="pipeline restarts within 10 minutes beyond which the server gives up and exits 1")


def _serve(args: argparse.Namespace) -> int:
    import asyncio

    import prometheus_client
    import torch
    from aiohttp import web

    from omni_tts.audio.ref_audio import UrlPolicy
    from omni_tts.config import load_stage_config, set_torch_threads
    from omni_tts.entrypoints.names import default_served_model_name
    from omni_tts.entrypoints.server import ServerConfig, build_app
    from omni_tts.models.qwen3_tts.random_model import default_model_dir
    from omni_tts.models.qwen3_tts.weights import resolve_model_dir
    from omni_tts.orchestrator.async_engine import AsyncTTSEngine

    if args.max_queue < 1:
        raise ValueError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.voices_quota_mb < 1:
        raise ValueError(f"--voices-quota-mb must be >= 1, got {args.voices_quota_mb}")
    allowed_hosts = [h for entry in args.ref_audio_allowed_hosts for h in entry.split(",") if h.strip()]
    if allowed_hosts and not args.allow_remote_ref_audio:
        raise ValueError("--ref-audio-allowed-hosts needs --allow-remote-ref-audio")
    ref_audio_urls = UrlPolicy.parse(allowed_hosts) if args.allow_remote_ref_audio else None
    if not args.body_read_timeout > 0:
        raise ValueError(f"--body-read-timeout must be > 0, got {args.body_read_timeout}")
    model_dir = resolve_model_dir(args.model) if args.model else default_model_dir()
    pipeline = load_stage_config(args.stage_config or ("qwen3_tts_1gpu" if torch.cuda.is_available() else "cpu_tiny"))
    names = tuple(args.served_model_name or [default_served_model_name(args.model, model_dir)])
    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    set_torch_threads(1)  # the API process only resamples and encodes; the cores belong to the stages
    # prometheus_client's text format shows each counter's and histogram's creation time as a gauge family of its
    # own (`…_created`, unit-less): noise beside the conventional names of /metrics
    prometheus_client.disable_created_metrics()
    if not (args.stage_heartbeat_timeout > 0 and args.first_audio_timeout > 0 and args.request_timeout > 0):
        raise ValueError("--stage-heartbeat-timeout, --first-audio-timeout and --request-timeout must be > 0")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    engine = AsyncTTSEngine(model_dir, pipeline, heartbeat_timeout=args.stage_heartbeat_timeout,
                            max_restarts=args.max_restarts)
    # giving up ends the process like a SIGTERM (graceful: answers in progress end, stages stop), exit status 1
    engine.on_fatal = lambda why: os.kill(os.getpid(), signal.SIGTERM)
    app = build_app(engine, ServerConfig(
        served_model_names=names, openai_model_aliases=args.openai_aliases, default_voice=args.default_voice,
        max_queue=args.max_queue, voices_dir=args.voices_dir,
        allowed_local_media_path=args.allowed_local_media_path, body_read_timeout=args.body_read_timeout,
        ref_audio_urls=ref_audio_urls, voices_quota_bytes=args.voices_quota_mb * 2**20, api_key=args.api_key or None,
        first_audio_timeout=args.first_audio_timeout, request_timeout=args.request_timeout))
    logging.getLogger("omni_tts").setLevel(logging.INFO)
    print(f"omni-tts: serving {model_dir} as '{names[0]}' on http://{args.host}:{args.port} (torch threads: "
          f"{', '.join(f'{stage} {n}' for stage, n in engine.threads.items())})", file=sys.stderr)
    web.run_app(app, host=args.host, port=args.port, handler_cancellation=True, print=None)
    if engine.fatal is not None:
        print(f"omni-tts serve: error: {engine.fatal}", file=sys.stderr)
        return 1
    return 0


def _synthesize(args: argparse.Namespace) -> int:
    import torch

    from omni_tts.models.qwen3_tts.model import Qwen3TTS
    from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
    from omni_tts.models.qwen3_tts.random_model import default_model_dir
    from omni_tts.models.qwen3_tts.sampling import SamplingParams

    out_ext = os.path.splitext(args.out)[1].lower()
    if out_ext not in (".wav", ".npy"):
        raise ValueError(f"--out must end in .wav or .npy, got {args.out!r}")
    if args.codes_out and not args.codes_out.lower().endswith(".npy"):
        raise ValueError(f"--codes-out must end in .npy, got {args.codes_out!r}")
    if args.ref_audio and not os.path.isfile(args.ref_audio):
        raise ValueError(f"--ref-audio {args.ref_audio!r}: file not found")
    tts = Qwen3TTS.from_pretrained(args.model or default_model_dir(), device=args.device,
                                   dtype=getattr(torch, args.dtype))
    voice = args.voice
    if voice is None and tts.model_type == "custom_voice":
        voice = tts.prompts.speakers[0]
    request = SynthesisRequest(
        text=args.text, task_type=args.task_type, voice=voice, language=args.language,
        instructions=args.instructions, ref_audio=args.ref_audio, ref_text=args.ref_text,
        x_vector_only=args.x_vector_only, non_streaming_mode=args.non_streaming_mode,
        sampling=SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                repetition_penalty=args.repetition_penalty, seed=args.seed,
                                max_new_tokens=args.max_new_tokens))
    result = tts.synthesize([request])[0]
    if out_ext == ".npy":
        np.save(args.out, result.audio.astype(np.float32))
    else:
        import soundfile as sf
        sf.write(args.out, result.audio, result.sample_rate, subtype="PCM_16")
    if args.codes_out:
        np.save(args.codes_out, result.codes)
    print(f"wrote {args.out}: {result.audio.shape[0] / result.sample_rate:.2f} s, {result.codes.shape[0]} frames, "
          f"finish_reason={result.finish_reason}", file=sys.stderr)
    return 0


def _make_tiny_model(args: argparse.Namespace) -> int:
    import torch

    from omni_tts.models.qwen3_tts.random_model import make_random_model

    make_random_model(args.out_dir, args.variant, args.preset, args.seed, getattr(torch, args.dtype))
    print(f"wrote {args.preset} {args.variant} checkpoint to {args.out_dir}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-tts", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_synthesize(sub)
    _add_make_tiny_model(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    handlers = {"serve": _serve, "synthesize": _synthesize, "make-tiny-model": _make_tiny_model}
    from omni_tts.models.qwen3_tts.config import ConfigError
    from omni_tts.models.qwen3_tts.weights import WeightsError

    try:
        return handlers[args.command](args)
    except (ValueError, ConfigError, WeightsError, FileExistsError) as e:
        print(f"omni-tts {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
