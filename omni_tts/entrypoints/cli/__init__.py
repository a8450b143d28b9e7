"""The `omni-tts` command: its arguments (commands.py) and the process bootstraps they start (serve.py, serve_ray.py,
narrate.py)."""
from omni_tts.entrypoints.cli.commands import main

__all__ = ["main"]
