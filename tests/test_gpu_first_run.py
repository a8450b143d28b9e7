"""benchmarks/gpu_first_run.sh in its CPU mode: the device checks (goldens, static == dynamic talker and decoder),
then gpu_suite.sh's SMOKE levels on the tiny model, then the report. Opt-in (--runslow): about a minute on 2 cores."""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_cpu_mode_writes_a_passing_report(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, CPU="1", RESULT_DIR=str(out), OMNI_TTS_CACHE=str(tmp_path / "cache"))
    run = subprocess.run(["bash", "benchmarks/gpu_first_run.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    assert report["checks"] and all(check["ok"] for check in report["checks"]), report["checks"]
    names = {check["name"] for check in report["checks"]}
    assert any(name.startswith("golden ") for name in names)
    assert any(name.startswith("decoder tiny: static == dynamic") for name in names)
    levels = report["suite"]["levels"]
    assert {level["label"] for level in levels} == {"c=1", "c=4", "rate=2/s"}
    assert all(level["ok"] == level["requests"] > 0 for level in levels)
    assert "## Serving" in (out / "report.md").read_text()
