"""omni_tts: an OpenAI-compatible, streaming text-to-speech server for Qwen3-TTS."""
from importlib import metadata


def package_version() -> str:
    """The installed distribution's version ("0+unknown" in a source tree that was never installed)."""
    try:
        return metadata.version("omni_tts")
    except metadata.PackageNotFoundError:
        return "0+unknown"
