"""Logging as the CLI and every stage process set it up: one format, one level for omni_tts's own loggers."""
from __future__ import annotations

import logging

LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: int) -> None:
    """omni_tts's loggers (the access log among them) at `level`; other libraries' at WARNING or above, so a debug
    run shows our details without every dependency's."""
    logging.basicConfig(level=max(level, logging.WARNING), format=LOG_FORMAT)
    logging.getLogger("omni_tts").setLevel(level)
