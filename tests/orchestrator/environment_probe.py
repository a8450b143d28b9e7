"""A stage entry point for test_processes.py: what this process's environment held when the module was imported
(before torch, as a stage module imports it), written as JSON with the environment the process was started with."""
import json
import os
import sys

AT_IMPORT = os.environ.get("OMP_WAIT_POLICY")

import torch  # noqa: E402,F401  the runtime a stage loads, after its environment


def main(path: str) -> None:
    with open(f"/proc/{os.getpid()}/environ", "rb") as f:   # the environment the parent spawned it with
        at_exec = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    with open(path, "w") as f:
        json.dump({"at_import": AT_IMPORT, "at_exec": at_exec.get(b"OMP_WAIT_POLICY", b"").decode() or None,
                   "torch_loaded": "torch" in sys.modules}, f)
