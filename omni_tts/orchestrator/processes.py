"""A stage's child process: how it is stopped, and how its end is told (the supervisor's and the aligner's)."""
from __future__ import annotations

import multiprocessing
import signal


def exit_description(process: multiprocessing.Process) -> str:
    """How a stage process ended, for a failure reason: `exited with status N`, `killed by signal SIGKILL`."""
    code = process.exitcode
    if code is None:  # its sentinel can close a moment before the exit status is there to collect
        return f"process {process.pid} exited"
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exited with status {code}"


def stop_process(process: multiprocessing.Process) -> None:
    process.join(5)
    if process.is_alive():
        process.terminate()
        process.join(3)
    if process.is_alive():
        process.kill()
        process.join()
