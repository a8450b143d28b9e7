"""The one start path of `omni-tts serve` and `omni-tts serve-ray`: `serve` binds the port before the model loads,
then serves what a loader builds (`local_pipeline` here: the stage processes of this machine; serve_ray.py's
`ray_replicas`) until SIGINT/SIGTERM (`api/socket_server.py`: 503 while loading, a drain, a second signal ends it
now), and says `ready: …` once it serves.

    commands._serve → serve(args, urls, local_pipeline) → socket_server.serve → build_app
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Callable, ContextManager

from omni_tts import package_version

if TYPE_CHECKING:  # imported where they are used: `serve` binds its port before these (and torch) are loaded
    from omni_tts.audio.url_fetch import UrlPolicy
    from omni_tts.config import PipelineConfig
    from omni_tts.entrypoints.api.pronunciation.dictionaries import ServerLexicons
    from omni_tts.entrypoints.api.server_config import ServerConfig
    from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig
    from omni_tts.orchestrator.async_tts import AsyncTTS
    from omni_tts.orchestrator.aligner_client import AlignerClient
    from omni_tts.entrypoints.api.socket_server import Loaded
    from omni_tts.orchestrator.tts_client import TTSClient

    # given the listener, the options and the ref_audio URL policy: the blocking load, valid while the context lasts
    Loader = Callable[[socket.socket, argparse.Namespace, UrlPolicy | None], ContextManager[Callable[[], Loaded]]]

logger = logging.getLogger("omni_tts.serve")
# what the ready line adds when the server serves the embedded tiny model: nothing else would tell its user why the
# audio is noise (the 0.6B figure: docs/benchmarks.md, "The released 0.6B shapes on a CPU")
RANDOM_WEIGHTS_NOTE = ("the embedded tiny model has random weights: it speaks noise, not speech. For speech, serve a "
                       "released checkpoint, on a GPU: omni-tts serve --model Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice "
                       "(on a CPU the 0.6B model runs ~7x slower than real time on 2 cores)")


def serve(args: argparse.Namespace, ref_audio_urls: UrlPolicy | None, loader: Loader) -> int:
    """Bind the port (before the model loads), then serve what `loader` loads on it until SIGINT/SIGTERM: 0 after
    a drain, 130 after a second Ctrl-C (`api/socket_server.py`); 1 when the port is taken, the stages do not start
    or the pipeline gives up."""
    from omni_tts.entrypoints.api import socket_server

    try:
        listener = _listen(args.host, args.port)
    except OSError as e:
        print_error(args.command, f"cannot listen on {args.host}:{args.port}: {e.strerror or e}")
        return 1
    with listener:
        _prepare_server_process()
        loaded: list[TTSClient] = []
        with loader(listener, args, ref_audio_urls) as load:
            def load_and_keep() -> Loaded:
                loaded.append((result := load())[0])
                return result

            try:
                status = socket_server.serve(listener, load_and_keep, args.keepalive_timeout)
            except Exception as e:
                from omni_tts.orchestrator.types import StageDeadError  # not before: the socket answers first

                if not isinstance(e, StageDeadError):
                    raise
                print_error(args.command, f"the pipeline did not start: {e}")  # a stage did not start
                return 1
    if loaded and loaded[0].fatal is not None:
        print_error(args.command, loaded[0].fatal)
        return 1
    return status


def _listen(host: str, port: int) -> socket.socket:
    """The server's socket, listening before the model loads: a busy port fails at once, no other process can take
    the port meanwhile, and connections made while the model loads are answered (503, `api/socket_server.py`)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio would: restarts reuse the port at once
        sock.bind(address)
        sock.listen()
    except OSError:
        sock.close()
        raise
    return sock


@contextlib.contextmanager
def local_pipeline(listener: socket.socket, args: argparse.Namespace,
                   ref_audio_urls: UrlPolicy | None) -> Iterator[Callable[[], Loaded]]:
    """`omni-tts serve`'s loader: the checkpoint, the app's config and the stage processes of this machine."""
    def load() -> Loaded:
        from omni_tts.config.options import from_options
        from omni_tts.config.settings import SupervisionSettings
        from omni_tts.orchestrator.async_tts import AsyncTTS
        from omni_tts.orchestrator.model_layout import ServedCheckpoint

        from omni_tts.entrypoints.cli.lora_arguments import check_adapters, with_lora_slots

        model_dir, stage_config, pipeline, names = load_checkpoint(args)
        more = load_more_models(args, names)
        pipeline = with_lora_slots(pipeline, args)
        check_adapters(args.loras, model_dir, pipeline)
        # before the stages: a bad option stops it
        config = server_config(args, names, ref_audio_urls, model_dir, tuple(more_names for more_names, _ in more))
        models = [ServedCheckpoint(names[0], model_dir)] + [ServedCheckpoint(n[0], d) for n, d in more]
        tts = AsyncTTS(models, pipeline, supervision=from_options(SupervisionSettings, args),
                       idle_unload=args.idle_unload, loras=args.loras)
        config.aligner = forced_aligner(args, tts)   # before the stages start: code2wav's may run it
        # giving up ends the process like a SIGTERM (a drain: what was in flight has failed already), exit status 1
        tts.on_fatal = lambda why: os.kill(os.getpid(), signal.SIGTERM)
        url = listener_url(listener)
        logger.info("omni-tts %s: loading %s (stage config %s) to serve at %s", package_version(),
                    ", ".join(model.model_dir for model in models), stage_config, url)
        return tts, config, ready_line(tts, [(names, model_dir), *more], url, config.random_weights)

    yield load


def load_checkpoint(args: argparse.Namespace) -> tuple[str, str, PipelineConfig, tuple[str, ...]]:
    """The checkpoint directory (downloaded or made if need be), the stage config's name and contents, and the
    served model names."""
    from omni_tts.entrypoints.api.names import default_served_model_name

    model_dir, stage_config, pipeline = load_pipeline(args)
    names = args.models[0].names or (default_served_model_name(args.model, model_dir),)
    return model_dir, stage_config, pipeline, names


def load_more_models(args: argparse.Namespace, names: tuple[str, ...]) -> list[tuple[tuple[str, ...], str]]:
    """The served names and checkpoint directory of each model after the default (`names`: its names);
    ValueError for a name two models share."""
    from omni_tts.entrypoints.api.names import default_served_model_name
    from omni_tts.models.qwen3_tts.weights import resolve_model_dir

    more, taken = [], set(names)
    for entry in args.models[1:]:
        model_dir = resolve_model_dir(entry.model)
        served = entry.names or (default_served_model_name(entry.model, model_dir),)
        if taken & set(served):
            raise ValueError(f"--model {entry.model}: the name {sorted(taken & set(served))[0]!r} is another "
                             "model's already; name it (NAME=MODEL)")
        taken |= set(served)
        more.append((served, model_dir))
    return more


def load_pipeline(args: argparse.Namespace) -> tuple[str, str, PipelineConfig]:
    """--model's checkpoint directory (downloaded or made if need be; the embedded tiny model by default), and
    --stage-config's name and contents, for a process that drives the stages and only encodes audio itself."""
    import torch

    from omni_tts.config import load_stage_config, set_torch_threads
    from omni_tts.models.qwen3_tts.random_model import default_model_dir
    from omni_tts.models.qwen3_tts.weights import resolve_model_dir

    set_torch_threads(1)  # this process only resamples and encodes; the cores belong to the stages
    model_dir = default_model_dir() if serves_embedded_model(args) else resolve_model_dir(args.model)
    stage_config = args.stage_config or ("qwen3_tts_1gpu" if torch.cuda.is_available() else "cpu_tiny")
    return model_dir, stage_config, load_stage_config(stage_config)


def serves_embedded_model(args: argparse.Namespace) -> bool:
    """Whether the server serves the embedded tiny model (no --model): random weights, made on first use."""
    return not args.model


def forced_aligner(args: argparse.Namespace, tts: AsyncTTS) -> AlignerClient | None:
    """The aligner of --forced-aligner's checkpoint (downloaded if need be), placed as the stage config's `aligner`
    says (placement code2wav: the pipeline, which starts first, is told to run it); by default the embedded tiny
    aligner beside the embedded tiny model, and none beside a real one (a random aligner's times mean nothing)."""
    from omni_tts.orchestrator.aligner_client import AlignerClient

    model_dir = forced_aligner_dir(args)
    if model_dir is None:
        return None
    aligner = AlignerClient(model_dir, tts.pipeline.aligner, tts.supervisor.supervision)
    if aligner.hosted:
        tts.supervisor.hosted_aligner = aligner.launch
    return aligner


def forced_aligner_dir(args: argparse.Namespace) -> str | None:
    """--forced-aligner's checkpoint directory, checked to be an aligner; the embedded one by default without
    --model."""
    from omni_tts.models.qwen3_forced_aligner.checkpoint_config import AlignerConfig
    from omni_tts.models.qwen3_forced_aligner.random_model import default_aligner_dir
    from omni_tts.models.qwen3_tts.weights import resolve_model_dir

    choice = args.forced_aligner
    if choice is None:
        return default_aligner_dir() if serves_embedded_model(args) else None
    if choice.lower() == "none":
        return None
    model_dir = resolve_model_dir(choice)
    AlignerConfig.load(model_dir)  # a checkpoint that is no aligner stops the server here, in one line
    return model_dir


def _prepare_server_process() -> None:
    import asyncio

    import prometheus_client

    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    # prometheus_client's text format shows each counter's and histogram's creation time as a gauge family of its
    # own (`…_created`, unit-less): noise beside the conventional names of /metrics
    prometheus_client.disable_created_metrics()


def server_config(args: argparse.Namespace, names: tuple[str, ...], ref_audio_urls: UrlPolicy | None,
                  model_dir: str, more_models: tuple[tuple[str, ...], ...] = ()) -> ServerConfig:
    """The app's config (`names`: the default model's served names, `model_dir` its checkpoint; `more_models`: the
    other models' served names); ValueError (one line) for a --default-voice the checkpoint lacks, a bad
    --voices-manifest or --aliases file: read from the checkpoint's config, before any stage starts."""
    from omni_tts.config.options import from_options
    from omni_tts.entrypoints.api.aliases import AliasFile, load_aliases
    from omni_tts.entrypoints.api.names import VoiceNames
    from omni_tts.entrypoints.api.server_config import ServerConfig
    from omni_tts.voices.manifest import load_voices_manifest
    from omni_tts.models.qwen3_tts.checkpoint_config import Qwen3TTSConfig

    checkpoint = Qwen3TTSConfig.load(model_dir)
    speakers = list(checkpoint.talker.spk_id)
    every_name = names + tuple(name for more in more_models for name in more)
    aliases = (load_aliases(args.aliases, checkpoint.tts_model_type, speakers, every_name) if args.aliases else
               AliasFile())
    VoiceNames(checkpoint.tts_model_type, speakers, args.default_voice, aliases.voices)
    manifest = load_voices_manifest(args.voices_manifest, checkpoint) if args.voices_manifest else None
    api_key = args.api_key or os.environ.get("OMNI_TTS_API_KEY") or None
    return from_options(ServerConfig, args, served_model_names=names, more_models=more_models, lora_dir=args.lora_dir,
                        voices_manifest=manifest, aliases=aliases,
                        ref_audio_urls=ref_audio_urls, api_key=api_key, random_weights=serves_embedded_model(args),
                        pronunciation=server_lexicons(args, checkpoint))


def server_lexicons(args: argparse.Namespace, checkpoint: Qwen3TTSConfig) -> ServerLexicons:
    """--pronunciation-dictionary's and --voice-pronunciation-dictionary's rules; ValueError (one line) for a file
    that cannot be used, or a voice that is no speaker of a CustomVoice checkpoint."""
    from omni_tts.entrypoints.api.pronunciation.rules_file import read_rules_file
    from omni_tts.entrypoints.api.pronunciation.dictionaries import ServerLexicons
    from omni_tts.models.qwen3_tts.lexicon import AliasRule, Lexicon

    def rules(flag: str, path: str) -> list[AliasRule]:
        try:
            return read_rules_file(path)
        except ValueError as e:
            raise ValueError(f"{flag} {e}") from None

    server = [rule for path in args.pronunciation_dictionary for rule in rules("--pronunciation-dictionary", path)]
    voices: dict[str, list[AliasRule]] = {}
    speakers = {name.lower() for name in checkpoint.talker.spk_id}
    for entry in args.voice_pronunciation_dictionary:
        voice, _, path = entry.partition("=")
        if not voice.strip() or not path:
            raise ValueError(f"--voice-pronunciation-dictionary takes VOICE=FILE, got {entry!r}")
        voice = voice.strip().lower()
        if checkpoint.tts_model_type == "custom_voice" and voice not in speakers:
            raise ValueError(f"--voice-pronunciation-dictionary {entry}: '{voice}' is not a speaker of this "
                             f"checkpoint; speakers: {', '.join(sorted(speakers))}")
        voices.setdefault(voice, []).extend(rules("--voice-pronunciation-dictionary", path))
    return ServerLexicons(Lexicon.combine([Lexicon(tuple(server))]),
                          {voice: Lexicon(tuple(found)) for voice, found in voices.items() if found})


def listener_url(listener: socket.socket) -> str:
    host, port = listener.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def ready_line(tts: AsyncTTS, models: list[tuple[tuple[str, ...], str]], url: str, random_weights: bool) -> str:
    """models: each model's served names and checkpoint directory, the default first."""
    stages = "; ".join(
        f"{name} on {cfg.device} ({cfg.dtype}, max batch {tts.batch_sizes[name]}, "
        f"{tts.threads[name]} torch thread{'s' if tts.threads[name] > 1 else ''})"
        for name, cfg in tts.pipeline.stages.by_name().items())
    served = ", ".join(f"{model_dir} as {quoted_names(names)}" for names, model_dir in models)
    shared = ""
    if len(models) > 1:
        layout = tts.layout
        shared = f" ({len(layout.talkers)} talkers, {len(layout.decoders)} code2wav)"
    return with_random_weights_note(f"ready: serving {served} at {url}{shared}; {stages}", random_weights)


def with_random_weights_note(ready: str, random_weights: bool) -> str:
    """The ready line, and for the embedded tiny model the note that it speaks noise."""
    return f"{ready}. Note: {RANDOM_WEIGHTS_NOTE}" if random_weights else ready


def quoted_names(served_model_names: tuple[str, ...]) -> str:
    return ", ".join(f"'{name}'" for name in served_model_names)


def print_error(command: str, message: str) -> None:
    print(f"omni-tts {command}: error: {message}", file=sys.stderr)

