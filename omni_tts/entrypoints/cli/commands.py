"""`omni-tts` command line: the OpenAI-compatible server, offline synthesis and narration, and random-weight
checkpoints."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import urllib.parse
from typing import TYPE_CHECKING, NoReturn

from omni_tts import package_version
from omni_tts.config import available_stage_configs
from omni_tts.config.options import add_options, check_bounds, from_options
from omni_tts.entrypoints.cli.lora_arguments import lora_arguments
from omni_tts.entrypoints.cli.model_arguments import model_arguments
from omni_tts.config.settings import ApiSettings, ListenerSettings, NarrationSettings, SupervisionSettings
from omni_tts.entrypoints.cli.serve import local_pipeline, print_error, serve
from omni_tts.log import LOG_LEVELS, configure_logging
from omni_tts.models.qwen3_tts.checkpoint_config import MODEL_TYPES, RANDOM_MODEL_PRESETS, ConfigError, WeightsError

FORCED_ALIGNER = "forced_aligner"
LORA = "lora"
MODEL_HELP = ("checkpoint directory or Hugging Face repo id, e.g. Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice (default: the "
              "embedded tiny model, whose weights are random: it speaks noise)")

if TYPE_CHECKING:  # imported where it is used: `serve` binds its port before it (and torch) is loaded
    from omni_tts.audio.url_fetch import UrlPolicy


class _ArgumentParser(argparse.ArgumentParser):
    """A usage error is one line, `omni-tts serve: error: …` (exit status 2), as every other CLI error: the usage
    of `serve` alone is a screenful that would bury it."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default: its value, or `off` for a switch (`--no-…` included: the switch is off, not its
    setting's True). Where there is no value to show (None, empty) the help text itself says what leaving the option
    out means, as it does where a switch's default needs more words than `off`."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if action.nargs == 0 and action.default is not argparse.SUPPRESS and "default" not in help:
            return f"{help} (default: off)"
        if action.default is None or isinstance(action.default, bool) or action.default in ([], ()):
            return action.help
        return super()._get_help_string(action)


def _add_log_level(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--log-level", choices=LOG_LEVELS, default=default,
                   help="omni_tts's log messages from this level up (the server's access log is info)")


def _add_synthesize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("synthesize", help="synthesize one utterance offline", formatter_class=_HelpFormatter)
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--text", required=True)
    p.add_argument("--task-type", choices=["CustomVoice", "VoiceDesign", "Base"])
    p.add_argument("--voice", help="CustomVoice speaker (default: the first speaker of the checkpoint)")
    p.add_argument("--language", help="e.g. English, Chinese; default Auto")
    p.add_argument("--instructions")
    p.add_argument("--ref-audio", help="reference clip for Base voice cloning")
    p.add_argument("--ref-text", help="transcript of --ref-audio (ICL cloning)")
    p.add_argument("--x-vector-only", action="store_true", help="clone from the speaker embedding only")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--non-streaming-mode", dest="non_streaming_mode", action="store_true", default=None,
                      help="prompt layout with the whole text up front (default: for every task but Base)")
    mode.add_argument("--streaming-mode", dest="non_streaming_mode", action="store_false",
                      help="prompt layout that feeds the text as it generates (default: for Base)")
    checkpoint = "(default: the checkpoint's generation_config.json)"
    p.add_argument("--temperature", type=float, help=f"0 = greedy {checkpoint}")
    p.add_argument("--top-k", type=int, help=checkpoint)
    p.add_argument("--top-p", type=float, help=checkpoint)
    p.add_argument("--repetition-penalty", type=float, help=checkpoint)
    p.add_argument("--seed", type=int, help="sampling seed (default: a random one)")
    p.add_argument("--max-new-tokens", type=int, help=checkpoint)
    p.add_argument("--device", default="cpu", help="torch device to run on")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="compute dtype")
    p.add_argument("--out", required=True, help="FILE.wav (16-bit PCM, 24 kHz) or FILE.npy (float32 samples)")
    p.add_argument("--codes-out", help="FILE.npy for the [T, 16] codes")
    p.add_argument("--lora", metavar="DIR", help="a PEFT LoRA adapter of the talker to synthesize with")
    _add_log_level(p, "warning")


def _add_narrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("narrate", help="narrate a text of any length into one audio file, resumable",
                       formatter_class=_HelpFormatter)
    p.add_argument("file", metavar="FILE.txt", help="the text (UTF-8); - reads stdin. Blank lines end paragraphs")
    p.add_argument("--out", required=True, help="the audio file; a partial one with its FILE.narration.json beside it "
                                                "is resumed by the same command")
    p.add_argument("--format", choices=["mp3", "wav", "flac", "opus", "pcm"],
                   help="(default: from --out's extension; .ogg is opus, .raw is pcm) a cut flac or opus narration "
                        "cannot be resumed, only restarted")
    p.add_argument("--restart", action="store_true", help="start again, ignoring a partial output")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--stage-config", help=f"stage layout: a shipped one ({', '.join(available_stage_configs())}) or "
                                          "a YAML file (default: qwen3_tts_1gpu with CUDA, else cpu_tiny)")
    p.add_argument("--voice", help="CustomVoice speaker or OpenAI voice name (default: the checkpoint's first speaker)")
    p.add_argument("--language", help="e.g. English, Chinese; default Auto")
    p.add_argument("--instructions", help="how to speak; VoiceDesign: the voice's description, designed once")
    p.add_argument("--ref-audio", help="Base: the reference clip to clone the voice of")
    p.add_argument("--ref-text", help="transcript of --ref-audio (ICL cloning; without it, the speaker embedding only)")
    checkpoint = "(default: the checkpoint's generation_config.json)"
    p.add_argument("--temperature", type=float, help=f"0 = greedy {checkpoint}")
    p.add_argument("--top-k", type=int, help=checkpoint)
    p.add_argument("--top-p", type=float, help=checkpoint)
    p.add_argument("--repetition-penalty", type=float, help=checkpoint)
    p.add_argument("--seed", type=int, help="segment i samples with seed + i (default: a seed drawn from the input's "
                                            "hash)")
    p.add_argument("--max-new-tokens", type=int, help=f"per segment {checkpoint}")
    add_options(p, NarrationSettings)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_log_level(p, "warning")


def _add_make_tiny_model(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("make-tiny-model", help="write a deterministic random-weight checkpoint (HF layout)",
                       formatter_class=_HelpFormatter)
    p.add_argument("out_dir")
    p.add_argument("--variant", required=True, choices=MODEL_TYPES + (FORCED_ALIGNER, LORA),
                   help=f"the checkpoint's tts_model_type, or {FORCED_ALIGNER} (a Qwen3-ForcedAligner: presets tiny, "
                        f"0.6b), or {LORA} (a PEFT LoRA adapter of the talker for the checkpoint --base)")
    p.add_argument("--base", metavar="DIR", help=f"{LORA}: the checkpoint the adapter is for")
    p.add_argument("--rank", type=int, default=4, help=f"{LORA}: the adapter's rank")
    p.add_argument("--preset", default="tiny", choices=RANDOM_MODEL_PRESETS, help="model size")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="dtype of model.safetensors (the speech tokenizer is always fp32, as released)")
    _add_log_level(p, "warning")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server", formatter_class=_HelpFormatter)
    _add_server_arguments(p)
    p.add_argument("--forced-aligner", metavar="DIR_OR_REPO_ID",
                   help="a Qwen3-ForcedAligner checkpoint (e.g. Qwen/Qwen3-ForcedAligner-0.6B) for word_timestamps, "
                        "run as a stage of its own (the stage config's `aligner`); 'none' for no aligner. Default: "
                        "the embedded tiny aligner with the embedded model, none with --model")


def _add_serve_ray(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve-ray", help="the same HTTP server in front of Ray Serve replicas (pip install "
                                         "-e '.[ray]'); joins the Ray cluster at $RAY_ADDRESS, else starts one here",
                       formatter_class=_HelpFormatter)
    _add_server_arguments(p)
    _add_replica_arguments(p)


def _add_server_arguments(p: argparse.ArgumentParser) -> None:
    """What `serve` and `serve-ray` share: the model, where to listen, the HTTP API's options (settings stated in
    config/settings.py) and each pipeline's supervision."""
    p.add_argument("--model", action="append", metavar="[NAME[,NAME...]=]MODEL",
                   help=f"{MODEL_HELP}; repeat it to serve several models (`serve`), the first the default, each "
                        "request choosing by its `model`")
    p.add_argument("--models", metavar="FILE", dest="models_file",
                   help="more models to serve, after --model's: a YAML or JSON file {\"models\": [{\"model\", "
                        "\"served_model_name\"?}]} (default: none)")
    p.add_argument("--idle-unload", type=float, metavar="SECONDS",
                   help="a model without requests for this long has its talker unloaded; its next request loads it "
                        "again (and waits for it) (default: never)")
    p.add_argument("--stage-config", help=f"stage layout: a shipped one ({', '.join(available_stage_configs())}) or "
                                          "a YAML file (default: qwen3_tts_1gpu with CUDA, else cpu_tiny)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="a LoRA adapter (PEFT layout) of the default model, loaded at start-up and served as model "
                        "NAME; repeatable (default: none)")
    p.add_argument("--lora-dir", metavar="DIR",
                   help="POST /v1/load_lora_adapter loads adapters from under DIR at run time (default: off)")
    p.add_argument("--max-loras", type=int, metavar="N",
                   help="LoRA adapters loaded at once, over the stage config's stages.talker.max_loras (default: "
                        "the stage config's; with --lora or --lora-dir and none there, 4)")
    p.add_argument("--max-lora-rank", type=int, metavar="R",
                   help="the highest adapter rank, over the stage config's stages.talker.max_lora_rank (default: "
                        "the stage config's)")
    add_options(p, ListenerSettings)
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the `model` values clients send; the first is the primary, listed first in /v1/models "
                        "(default: the checkpoint folder's name)")
    add_options(p, ApiSettings)
    p.add_argument("--voices-manifest", metavar="FILE",
                   help="Base models: read-only voices prepared offline, a JSON or YAML file {\"voices\": [{\"name\", "
                        "\"audio\" (a path relative to the file), \"ref_text\"?, \"consent\"?}]}, checked at start-up; "
                        "listed and spoken as uploaded voices, never replaced or deleted (default: none)")
    p.add_argument("--pronunciation-dictionary", action="append", default=[], metavar="FILE",
                   help="alias rules for every request: a PLS lexicon (XML) or JSON rules ([{\"string_to_replace\", "
                        "\"alias\", \"case_sensitive\"?, \"word_boundaries\"?}]); repeatable, the first file's "
                        "rules first; a request's and its voice's dictionaries come before them (default: none)")
    p.add_argument("--voice-pronunciation-dictionary", action="append", default=[], metavar="VOICE=FILE",
                   help="alias rules for the requests that speak VOICE (a speaker, or an uploaded voice's name), "
                        "before the server's; repeatable (default: none)")
    p.add_argument("--aliases", metavar="FILE",
                   help="names clients hard-code, over the default table (README: Models and voices): a JSON or YAML "
                        "file {\"voices\": {alias: speaker or uploaded voice}, \"models\": {alias: served model "
                        "name}}, checked at start-up (default: the table alone)")
    p.add_argument("--allow-remote-ref-audio", action="store_true",
                   help="fetch http(s) ref_audio URLs (public addresses only, unless --ref-audio-allowed-hosts)")
    p.add_argument("--ref-audio-allowed-hosts", action="append", default=[], metavar="HOST_OR_CIDR[,…]",
                   help="hosts, addresses or networks ref_audio URLs may reach although they are not public "
                        "(loopback, private, link-local); repeatable or comma-separated (default: none: public "
                        "addresses only)")
    p.add_argument("--api-key",  # the default is read later: --help must not print the key
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $OMNI_TTS_API_KEY)")
    add_options(p, SupervisionSettings)
    _add_log_level(p, "info")


def _add_replica_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int,
                   help="a fixed number of replicas, each one pipeline (default: 1, or autoscaling when "
                        "--min-replicas or --max-replicas is given)")
    p.add_argument("--min-replicas", type=int, help="autoscaling: the fewest replicas (default 1)")
    p.add_argument("--max-replicas", type=int, help="autoscaling: the most replicas (default: --min-replicas)")
    p.add_argument("--target-ongoing-requests", type=float, default=8.0,
                   help="autoscaling: the requests per replica Ray scales towards (one replica's real-time "
                        "capacity: docs/deploy.md)")
    p.add_argument("--cpus-per-replica", type=float, default=1.0,
                   help="Ray CPUs each replica takes; its CPU stages' threads split that many cores (at least 1)")
    p.add_argument("--gpus-per-replica", type=float,
                   help="Ray GPUs each replica takes, fractional for several replicas per GPU (default: the stage "
                        "config's CUDA devices, 0 on the CPU)")
    p.add_argument("--app-name", help="the Ray Serve application's name (default: omni-tts-HOST-PORT, one per front "
                                      "end in a shared cluster)")


def _serve(args: argparse.Namespace) -> int:
    return serve(args, _check_server_arguments(args), local_pipeline)


def _serve_ray(args: argparse.Namespace) -> int:
    try:
        import ray.serve  # noqa: F401 — an optional extra
    except ImportError:
        print_error(args.command, "Ray Serve is not installed; install it with: pip install -e '.[ray]'")
        return 1
    from omni_tts.entrypoints.cli import serve_ray

    ref_audio_urls = _check_server_arguments(args)
    serve_ray.check_arguments(args)
    return serve(args, ref_audio_urls, serve_ray.ray_replicas)


def _check_server_arguments(args: argparse.Namespace) -> UrlPolicy | None:
    """ValueError for a bad option; the policy for http(s) ref_audio (None: URLs are refused)."""
    from omni_tts.audio.url_fetch import UrlPolicy

    for settings in (ListenerSettings, ApiSettings, SupervisionSettings):
        check_bounds(from_options(settings, args))
    args.models = model_arguments(args)
    args.loras = lora_arguments(args)
    args.model = args.models[0].model   # the default model, as a one-model option reads it
    if args.idle_unload is not None and not args.idle_unload > 0:
        raise ValueError(f"--idle-unload must be > 0 seconds, got {args.idle_unload}")
    allowed_hosts = [h for entry in args.ref_audio_allowed_hosts for h in entry.split(",") if h.strip()]
    if allowed_hosts and not args.allow_remote_ref_audio:
        raise ValueError("--ref-audio-allowed-hosts needs --allow-remote-ref-audio")
    ref_audio_urls = UrlPolicy.parse(allowed_hosts) if args.allow_remote_ref_audio else None
    for origin in args.allowed_origins:
        parts = urllib.parse.urlsplit(origin)
        if origin != "*" and not (parts.scheme in ("http", "https") and parts.netloc and not parts.path.strip("/")
                                  and not parts.query and not parts.fragment):
            raise ValueError(f"--allowed-origins takes origins such as https://app.example:8443 (or *), got {origin!r}")
    return ref_audio_urls


def _synthesize(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from omni_tts.engine.offline import synthesize
    from omni_tts.models.qwen3_tts.lora import read_adapter
    from omni_tts.models.qwen3_tts.model import Qwen3TTS
    from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
    from omni_tts.models.qwen3_tts.random_model import default_model_dir
    from omni_tts.models.qwen3_tts.sampling_params import SamplingParams

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
        sampling=SamplingParams.of(args))
    lora = None if args.lora is None else read_adapter(args.lora, tts.config.talker)
    result = synthesize(tts, [request], loras=[lora])[0]
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


def _narrate(args: argparse.Namespace) -> int:
    from omni_tts.entrypoints.cli.narrate import run

    return run(args)


def _make_tiny_model(args: argparse.Namespace) -> int:
    import torch

    if args.variant == LORA:
        from omni_tts.models.qwen3_tts.random_model import make_random_adapter

        if args.base is None or args.rank < 1:
            raise ValueError(f"--variant {LORA} needs --base DIR and a --rank >= 1")
        make_random_adapter(args.out_dir, args.base, args.seed, args.rank)
        print(f"wrote a rank-{args.rank} LoRA adapter for {args.base} to {args.out_dir}", file=sys.stderr)
        return 0
    if args.variant == FORCED_ALIGNER:
        from omni_tts.models.qwen3_forced_aligner.random_model import make_random_aligner

        make_random_aligner(args.out_dir, args.preset, args.seed, getattr(torch, args.dtype))
    else:
        from omni_tts.models.qwen3_tts.random_model import make_random_model

        make_random_model(args.out_dir, args.variant, args.preset, args.seed, getattr(torch, args.dtype))
    print(f"wrote {args.preset} {args.variant} checkpoint to {args.out_dir}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(prog="omni-tts", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_serve_ray(sub)
    _add_synthesize(sub)
    _add_narrate(sub)
    _add_make_tiny_model(sub)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """argparse reports an option no subcommand knows as the top-level parser's; it is the subcommand's usage error
    (`omni-tts serve: error: unrecognized arguments: …`)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        subcommands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    configure_logging(getattr(logging, args.log_level.upper()))
    handlers = {"serve": _serve, "serve-ray": _serve_ray, "synthesize": _synthesize, "narrate": _narrate,
                "make-tiny-model": _make_tiny_model}
    try:
        return handlers[args.command](args)
    except (ValueError, ConfigError, WeightsError, FileExistsError) as e:
        print_error(args.command, str(e))
        return 2

