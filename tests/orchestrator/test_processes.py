"""Stage-process supervision (orchestrator/processes.py), the one way the pipeline and the forced aligner are watched
and restarted, with real processes: a load that hangs meets the load deadline, an exit is told by the stage's own
report or else by how it ended (the signal named even when the process's files close well before its end), restarts
back off and give up after max_restarts, a restarted aligner that hangs while loading is killed and started again (it
used to be waited for for ever), and a span the aligner does not answer within timeout_s gets no words."""
import asyncio
import dataclasses
import json
import os
import shutil
import signal
import sys
import time

import numpy as np
import pytest

import environment_probe
from conftest import FIXTURES
from omni_tts.config.settings import SupervisionSettings
from omni_tts.config.stage_config import AlignerStageConfig
from omni_tts.orchestrator.aligner_client import AlignerClient, AlignerUnavailable
from omni_tts.orchestrator.processes import (FAILURE_REPORT_GRACE, Restarts, StageWatch, spawn, stop_process,
                                             wait_ready)
from omni_tts.orchestrator.types import StageDeadError
from waiting import RESTART_TIMEOUT, eventually_async

ALIGNER = FIXTURES.parent / "qwen3_forced_aligner" / "tiny-forced-aligner"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def exit_slowly() -> None:
    """Closes its files, its sentinel among them, well before it ends (by SIGKILL), as a dying process that the
    scheduler preempts between the two does (the aligner, at niceness 10, killed on a busy machine): the delay
    stands for that preemption, nobody waits on it."""
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    time.sleep(4 * FAILURE_REPORT_GRACE)
    os.kill(os.getpid(), signal.SIGKILL)


def test_the_backoff_doubles_from_none_up_to_its_cap():
    assert [SupervisionSettings().backoff(n) for n in range(8)] == [0, 1, 2, 4, 8, 16, 30, 30]


def test_a_stage_that_hangs_while_loading_meets_the_load_deadline():
    async def main():
        stage = StageWatch("talker", spawn(time.sleep, (3600,), "omni-tts-test", "talker"))  # never reports Ready
        try:
            with pytest.raises(StageDeadError, match=r"^stage talker was not ready within 0.5 s$"):
                await wait_ready([stage], 0.5)
        finally:
            stage.process.kill()
            stop_process(stage.process)
    asyncio.run(main())


@pytest.mark.parametrize("user_value", [None, "ACTIVE"])
def test_a_stage_sets_its_environment_itself_before_it_loads_torch(tmp_path, monkeypatch, user_value):
    """The talker's OMP_WAIT_POLICY is in its environment when its module loads torch, and only there: the parent
    spawns it with its own environment unchanged (it never changes os.environ while its threads run)."""
    if user_value is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", user_value)
    for stage, expected in (("talker", user_value or "PASSIVE"), ("code2wav", user_value)):
        report = tmp_path / f"{stage}.json"
        process = spawn(environment_probe.main, (str(report),), "omni-tts-test", stage)
        process.join(120)
        assert process.exitcode == 0
        assert json.loads(report.read_text()) == {"at_import": expected, "at_exec": user_value,
                                                  "torch_loaded": True}


@pytest.mark.parametrize("target,args,report,why", [
    (time.sleep, (3600,), None, "killed by signal SIGKILL"),
    (exit_slowly, (), None, "killed by signal SIGKILL"),   # it was "process N exited"
    (sys.exit, (3,), None, "exited with status 3"),
    (sys.exit, (1,), "RuntimeError: the stage's own words", "RuntimeError: the stage's own words"),
])
def test_an_exit_is_told_by_the_stage_s_report_else_by_how_it_ended(target, args, report, why):
    async def main():
        stage = StageWatch("code2wav", spawn(target, args, "omni-tts-test", "code2wav"))
        ended = asyncio.get_running_loop().create_future()
        stage.watch_exit(ended.set_result)
        if report is not None:
            stage.on_failed(report)
        if target is time.sleep:
            stage.process.kill()
        try:
            assert await asyncio.wait_for(ended, 60) == why
        finally:
            stop_process(stage.process)
    asyncio.run(main())


def test_restarts_back_off_and_give_up_after_max_restarts():
    async def main():
        calls = []

        async def stop():
            calls.append("stop")

        async def start_fails():
            calls.append("start")
            raise StageDeadError("stage x was not ready within 1 s")

        restarts = Restarts("unit", SupervisionSettings(max_restarts=2, max_backoff=0.01))
        assert not await restarts.restart(stop, start_fails, "stage x exited with status 1")
        assert calls == ["stop", "start", "stop", "start", "stop"]
        assert restarts.fatal == "2 restarts within 600 s; last: stage x exited with status 1"

        starts = iter([StageDeadError("not ready"), None])

        async def start_fails_once():
            if (error := next(starts)) is not None:
                raise error
        calls.clear()
        again = Restarts("unit", SupervisionSettings(max_restarts=2, max_backoff=0.01))
        assert await again.restart(stop, start_fails_once, "") and again.fatal is None
    asyncio.run(main())


def test_a_restarted_aligner_that_hangs_while_loading_is_killed_and_started_again(tmp_path):
    checkpoint, saved = tmp_path / "aligner", tmp_path / "config.json"
    shutil.copytree(ALIGNER, checkpoint)
    config = checkpoint / "config.json"
    shutil.copy(config, saved)

    async def main():
        aligner = AlignerClient(str(checkpoint), AlignerStageConfig(), SupervisionSettings())
        await aligner.start()
        try:
            first = aligner.status()["pid"]
            # from now on a load blocks reading its config (a FIFO nobody writes), past a short load deadline
            os.mkfifo(tmp_path / "fifo")
            os.replace(tmp_path / "fifo", config)
            aligner.supervision = dataclasses.replace(aligner.supervision, startup_timeout=1.0)
            os.kill(first, signal.SIGKILL)
            hung = await eventually_async(lambda: aligner.status()["pid"] != first and aligner.status()["pid"],
                                          what="a restart")
            await eventually_async(lambda: aligner.status()["pid"] not in (first, hung),
                                   what="the hung restart tried again")
            assert not aligner.status()["ready"]
            await eventually_async(lambda: not alive(hung), what="the hung load killed")
            # loads that can finish: their config and a generous deadline again (no restart starts between these
            # two lines: it runs on this event loop)
            os.replace(saved, config)
            aligner.supervision = dataclasses.replace(aligner.supervision, startup_timeout=300.0)
            status = await eventually_async(lambda: aligner.status()["ready"] and aligner.status(),
                                            RESTART_TIMEOUT, "the aligner back")
            assert status["pid"] not in (first, hung)
        finally:
            await aligner.shutdown()
    asyncio.run(main())


def test_a_span_the_aligner_does_not_answer_within_timeout_s_gets_no_words():
    async def main():
        # no heartbeat timeout ends the hold: only timeout_s does
        aligner = AlignerClient(str(ALIGNER), AlignerStageConfig(timeout_s=1.0),
                                SupervisionSettings(heartbeat_timeout=3600.0))
        await aligner.start()
        pid = aligner.status()["pid"]
        os.kill(pid, signal.SIGSTOP)   # held by state: it reads nothing
        try:
            with pytest.raises(AlignerUnavailable, match=r"^the aligner did not answer within 1 s$"):
                await aligner.align("request", 0, np.zeros(24000, np.float32), 24000, "Hello world.", None)
            assert aligner.status() == {"ready": True, "reason": None, "placement": "process", "pid": pid,
                                        "pending": 0}
        finally:
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
            await aligner.shutdown()
    asyncio.run(main())
