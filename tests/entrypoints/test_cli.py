"""`omni-tts` as a user runs it (real processes): --version, defaults in --help (every `serve` flag's, and the
README's synopsis of them), the embedded model saying it speaks noise, every way `serve` can fail before it serves —
a bad or busy port, a device the machine lacks, an unloadable model, a stage that raises while it starts — each one
line on stderr and a non-zero exit without a traceback, and a quiet Ctrl+C."""
import importlib.metadata
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import FIXTURES
from omni_tts.entrypoints.cli import main
from server_util import ServerProcess, free_port, request, stage_pids

CLI = [sys.executable, "-m", "omni_tts.entrypoints.cli"]
README = Path(__file__).resolve().parents[2] / "README.md"


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout)


def assert_one_line_error(result: subprocess.CompletedProcess, status: int, message: str,
                          command: str = "serve") -> None:
    """Exit `status`; stderr is nothing but `omni-tts serve: error: …` containing `message` (no log, no traceback)."""
    assert result.returncode == status, (result.returncode, result.stderr)
    assert result.stderr.startswith(f"omni-tts {command}: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr, result.stderr
    assert result.stdout == ""


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout == f"omni-tts {importlib.metadata.version('omni_tts')}\n"


@pytest.mark.parametrize("command,defaults", [
    ("serve", ["--port PORT", "(default: 8000)", "(default: 127.0.0.1)", "(default: 256)", "(default: info)",
               "(default: $OMNI_TTS_API_KEY)", "(default: qwen3_tts_1gpu with CUDA, else cpu_tiny)"]),
    ("serve-ray", ["(default: 8000)", "(default: 8.0)", "(default: 1.0)", "(default: $OMNI_TTS_API_KEY)",
                   "(default: qwen3_tts_1gpu with CUDA, else cpu_tiny)", "(default: omni-tts-HOST-PORT"]),
    ("synthesize", ["(default: cpu)", "(default: float32)", "(default: warning)",
                    "(default: the checkpoint's generation_config.json)"]),
    ("narrate", ["(default: 250)", "(default: 750)", "(default: 300)", "(default: 3)", "(default: warning)",
                 "(default: from --out's extension", "(default: a seed drawn from the input's hash)"]),
    ("make-tiny-model", ["(default: tiny)", "(default: 0)", "(default: bfloat16)", "(default: warning)"]),
])
def test_help_shows_the_defaults(command, defaults, capsys, monkeypatch):
    monkeypatch.setenv("OMNI_TTS_API_KEY", "secret-key-never-shown")
    monkeypatch.setenv("COLUMNS", "200")  # one option per line: the defaults are not wrapped apart
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    for default in defaults:
        assert default in text, default
    assert "(default: None)" not in text and "secret-key-never-shown" not in text


def help_entries(command: str, capsys, monkeypatch) -> dict[str, str]:
    """`omni-tts COMMAND --help`'s options section: each option's flags (its invocation, e.g. `--port PORT`)
    → its help text, wrapped lines joined."""
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit):
        main([command, "--help"])
    options = capsys.readouterr().out.split("\noptions:\n", 1)[1]
    entries: dict[str, str] = {}
    for line in options.splitlines():
        if line.startswith("  -"):  # an option: its invocation, then (after two spaces) its help, or on the next line
            invocation, _, text = line.strip().partition("  ")
            entries[invocation] = text.strip()
        else:
            entries[invocation] = f"{entries[invocation]} {line.strip()}".strip()
    return entries


def flags(text: str) -> list[str]:
    return re.findall(r"(?<![\w-])--[a-z][a-z-]*", text)


def test_every_serve_flag_shows_its_default_or_says_it_has_none(capsys, monkeypatch):
    entries = help_entries("serve", capsys, monkeypatch)
    entries.pop("-h, --help")
    assert len(entries) > 20  # the parse found them
    for invocation, text in entries.items():
        assert re.search(r"\bdefault\b", text, re.IGNORECASE), (invocation, text)
        # a Python value is no answer: a negated switch's True, an unset option's None, an empty list
        assert not re.search(r"\(default: (None|True|False|\[\])\)", text), (invocation, text)
    assert entries["--no-openai-aliases"].endswith("as the server does by default")
    assert entries["--allow-remote-ref-audio"].endswith("(default: off)")


def readme_synopses() -> dict[str, str]:
    """The README's synopsis of each command: in a code block, a line `omni-tts COMMAND … [--…` (not an example: it
    shows optional flags) and the indented lines after it."""
    synopses: dict[str, str] = {}
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL):
        for entry in re.split(r"\n(?=\S)", block):
            if match := re.match(r"omni-tts ([a-z-]+) .*\[--", entry, re.DOTALL):
                assert match[1] not in synopses, f"two synopses of {match[1]}"
                synopses[match[1]] = entry
    return synopses


@pytest.mark.parametrize("command", ["serve", "synthesize", "narrate", "make-tiny-model"])
def test_the_readmes_synopsis_lists_exactly_the_flags_of_help(command, capsys, monkeypatch):
    listed = flags(readme_synopses()[command])
    helped = [flag for invocation in help_entries(command, capsys, monkeypatch) for flag in flags(invocation)]
    helped.remove("--help")
    assert len(set(listed)) == len(listed), listed
    assert sorted(listed) == sorted(helped)


def test_the_embedded_model_says_it_speaks_noise(tmp_path):
    """Without --model the server serves the embedded tiny model, whose weights are random: its ready line and
    /v1/models say so (the playground shows it: test_playground.py); a checkpoint given by --model: test_server.py."""
    server = ServerProcess("--forced-aligner", "none", env={"OMNI_TTS_CACHE": str(tmp_path)})
    try:
        status, _, body = request(server.url + "/v1/models")
        assert status == 200 and [entry["random_weights"] for entry in json.loads(body)["data"]] == [True] * 5
    finally:
        output = server.stop()
    ready = next(line for line in output.splitlines() if " ready: " in line)
    assert f"ready: serving {tmp_path / 'tiny-custom-voice-v1'} as 'tiny-custom-voice-v1' " in ready
    assert "the embedded tiny model has random weights: it speaks noise, not speech" in ready
    assert "omni-tts serve --model Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice" in ready


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_bad_port_is_a_usage_error(port):
    result = run_cli("serve", "--port", port)
    assert_one_line_error(result, 2, "argument --port: must be ")


def test_busy_port_fails_at_once_before_loading_anything(tmp_path):
    """The model is an empty folder: had anything been read from it first, that would be the error."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = run_cli("serve", "--port", str(port), "--model", str(tmp_path))
    assert_one_line_error(result, 1, f"cannot listen on 127.0.0.1:{port}: Address already in use")


def test_serve_ray_without_ray_says_how_to_install_it():
    """Ray is an optional extra: the base package never imports it, and serve-ray without it is one line."""
    hide_ray = ("import sys; sys.modules['ray'] = None; from omni_tts.entrypoints.cli import main; "
                f"sys.exit(main(['serve-ray', '--port', '{free_port()}']))")
    result = subprocess.run([sys.executable, "-c", hide_ray], capture_output=True, text=True, timeout=120)
    assert_one_line_error(result, 1, "Ray Serve is not installed; install it with: pip install -e '.[ray]'",
                          command="serve-ray")


@pytest.mark.parametrize("args,message", [
    (["--replicas", "2", "--max-replicas", "3"], "--replicas fixes the number of replicas"),
    (["--min-replicas", "3", "--max-replicas", "2"], "--max-replicas >= --min-replicas, got 3 and 2"),
    (["--cpus-per-replica", "1000"], "1 replicas of 1000 CPUs do not fit the "),
])
def test_serve_ray_replica_options_that_cannot_work_are_one_line(args, message):
    pytest.importorskip("ray.serve")
    result = run_cli("serve-ray", "--port", str(free_port()), "--model", str(FIXTURES / "tiny-custom-voice"), *args)
    assert_one_line_error(result, 2, message, command="serve-ray")


def test_missing_device_is_named_before_any_stage_starts(tmp_path):
    absent = f"cuda:{torch.cuda.device_count()}"  # one past this machine's last GPU (cuda:0 on a CPU machine)
    layout = tmp_path / "gpu.yaml"
    layout.write_text(f"stages:\n  talker: {{device: cpu}}\n  code2wav: {{device: '{absent}'}}\n")
    result = run_cli("serve", "--port", str(free_port()), "--model", str(FIXTURES / "tiny-custom-voice"),
                     "--stage-config", str(layout))
    assert_one_line_error(result, 2, f"device {absent} of stage code2wav does not exist (torch sees ")


@pytest.mark.parametrize("sampling,message", [
    ("{temperature: 1000}", "sampling.temperature: must be a number in [0, 100] or null, got 1000"),
    ("{max_new_tokens: 1}", "sampling.max_new_tokens: must be an integer in 2..8192 or null, got 1"),
])
def test_sampling_default_out_of_range_fails_at_start_naming_the_key(tmp_path, sampling, message):
    """A YAML default no request could send is refused when the server starts, not answered later as a 400 about a
    field the client never sent (or a 500)."""
    layout = tmp_path / "bad_sampling.yaml"
    layout.write_text(f"stages:\n  talker: {{device: cpu}}\n  code2wav: {{device: cpu}}\nsampling: {sampling}\n")
    result = run_cli("serve", "--port", str(free_port()), "--model", str(FIXTURES / "tiny-custom-voice"),
                     "--stage-config", str(layout))
    assert_one_line_error(result, 2, f"{layout}: {message}")


@pytest.mark.parametrize("damage", ["missing", "config"])
def test_unloadable_model_is_one_line(damage, tmp_path):
    model = tmp_path / "model"
    if damage == "config":
        shutil.copytree(FIXTURES / "tiny-custom-voice", model)
        (model / "config.json").write_text("{ not json")
    result = run_cli("serve", "--port", str(free_port()), "--model", str(model))
    assert_one_line_error(result, 2, str(model))


def test_stage_that_raises_at_start_reports_its_own_error(tmp_path):
    """Both stages read the speech tokenizer's weights in their own process; garbage there makes them raise while
    they load. The reason the user sees is that exception's own text, not merely that a process exited."""
    model = tmp_path / "model"
    shutil.copytree(FIXTURES / "tiny-custom-voice", model)
    weights = model / "speech_tokenizer" / "model.safetensors"
    weights.write_bytes(json.dumps({"not": "safetensors"}).encode() * 8)
    with pytest.raises(Exception) as raised:
        safe_open(str(weights), framework="pt")
    own_error = f"{type(raised.value).__name__}: {raised.value}"
    result = run_cli("serve", "--port", str(free_port()), "--model", str(model), "--log-level", "warning")
    assert_one_line_error(result, 1, "the pipeline did not start: stage ")
    assert f"failed: {own_error}\n" in result.stderr


def test_ctrl_c_stops_the_server_and_its_stages_quietly():
    """Ctrl+C in a terminal sends SIGINT to the whole process group, the stages included: the server shuts them
    down itself, none dies of the signal (no traceback, no restart), and it exits 0."""
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"))
    pids = stage_pids(server.proc.pid)
    for pid in [server.proc.pid, *pids]:
        os.kill(pid, signal.SIGINT)
    assert server.proc.wait(30) == 0
    output = server.output()
    assert "Traceback" not in output and "failed" not in output, output
