"""A stage process's first step: its environment, then its entry point. Runtimes read variables such as
OMP_WAIT_POLICY once, as they load, so the environment must be in place before the entry's module (which loads
torch) is imported: the entry comes as "module:name" and is imported here, after the environment is set. Setting it
here, in the child, leaves the parent's os.environ alone while its threads run. Imports nothing heavy."""
from __future__ import annotations

import importlib
import os


def run(environment: dict[str, str], entry: str, *args: object) -> None:
    """Set `environment`, import `entry` ("package.module:function") and call it with `args`."""
    os.environ.update(environment)
    module, name = entry.split(":")
    getattr(importlib.import_module(module), name)(*args)
