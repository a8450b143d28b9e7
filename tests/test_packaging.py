"""The wheel serves on its own: built from the repository, installed into a fresh virtualenv outside it and started
from a directory outside it, `omni-tts serve` finds everything it reads at run time (stage configs, tokenizer
assets for the embedded tiny model, the /docs and playground pages) inside the installed package, and needs nothing
that only the test extra installs (the README's serving set-up installs the package alone)."""
import io
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import soundfile as sf

from server_util import ServerProcess, environment, request

REPO = Path(__file__).resolve().parents[1]


def build_wheel(out_dir: Path, work_dir: Path) -> Path:
    """The wheel of the repository's package, built from a copy of what the build reads: a build inside the
    repository would leave a build/ folder there, whose stale files a later wheel would take along."""
    source = work_dir / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "omni_tts", source / "omni_tts", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                    "-w", str(out_dir), str(source)], check=True, capture_output=True)
    [wheel] = out_dir.glob("omni_tts-*.whl")
    return wheel


def see_installed_dependencies(venv: Path) -> None:
    """Let `venv` import torch and the other dependencies from where this interpreter has them — a virtualenv, a
    conda env or a system Python alike (`--system-site-packages` would give the base interpreter's, not a venv's).
    The directories go in a .pth file, so they come after the venv's own site-packages: its wheel wins over this
    interpreter's (editable) omni_tts, whose own .pth hooks are not run for directories listed this way."""
    here = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    [site_packages] = (venv / "lib").glob("python*/site-packages")
    (site_packages / "installed_dependencies.pth").write_text("\n".join(here) + "\n")


def modules_of_the_test_extra() -> list[str]:
    """The top-level modules of the packages the test extra names, the extras it includes expanded (`ray[serve]` →
    ray, `openapi-spec-validator` → openapi_spec_validator)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    requirements = list(extras["test"])
    for requirement in requirements:
        if included := re.fullmatch(r"omni_tts\[(.*)\]", requirement):
            requirements += [r for extra in included[1].split(",") for r in extras[extra]]
    names = [re.match(r"[\w.-]+", r)[0] for r in requirements if not r.startswith("omni_tts[")]
    return [name.lower().replace("-", "_") for name in names]


def hide_test_extra(venv: Path) -> None:
    """Every process of `venv` (the server and its stages) finds the test extra's packages missing, as a set-up that
    installed the package alone would (None in sys.modules: `import` raises ImportError)."""
    [site_packages] = (venv / "lib").glob("python*/site-packages")
    (site_packages / "hide_test_extra.pth").write_text(
        f"import sys; sys.modules.update(dict.fromkeys({modules_of_the_test_extra()!r}))\n")


def test_wheel_installed_outside_the_repository_serves(tmp_path):
    assert REPO not in tmp_path.parents
    wheel = build_wheel(tmp_path / "dist", tmp_path)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    see_installed_dependencies(venv)
    hide_test_extra(venv)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                    "--no-index", "-q", str(wheel)], check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PYTHONPATH": None, "OMNI_TTS_CACHE": str(tmp_path / "cache")}  # the tiny model made from the wheel's assets
    installed = subprocess.run([str(venv / "bin" / "python"), "-c", "import omni_tts; print(omni_tts.__file__)"],
                               cwd=elsewhere, env=environment(env),
                               capture_output=True, text=True, check=True).stdout.strip()
    assert Path(installed).is_relative_to(venv / "lib"), installed
    korean = "from omni_tts.models.qwen3_forced_aligner import words; print(words.split_words('서울입니다', 'Korean'))"
    words = subprocess.run([str(venv / "bin" / "python"), "-c", korean], cwd=elsewhere, env=environment(env),
                           capture_output=True, text=True, check=True).stdout.strip()
    assert words == "['서울', '입니다']"  # the aligner's Korean dictionary, from the package data
    hidden = subprocess.run([str(venv / "bin" / "python"), "-c", "import pytest"], cwd=elsewhere, env=environment(env),
                            capture_output=True, text=True)
    assert hidden.returncode == 1 and "ModuleNotFoundError" in hidden.stderr, hidden.stderr
    server = ServerProcess(env=env, command=[str(venv / "bin" / "omni-tts")], cwd=str(elsewhere))
    try:
        status, headers, body = request(server.url + "/v1/audio/speech", {
            "model": "tiny-custom-voice-v1", "input": "Served from the wheel.", "voice": "ryan",
            "response_format": "wav", "max_new_tokens": 12})
        assert status == 200 and headers["Content-Type"] == "audio/wav", body[:300]
        audio, rate = sf.read(io.BytesIO(body))
        assert rate == 24000 and len(audio) > 0
        status, _, health = request(server.url + "/health")
        health = json.loads(health)  # the embedded tiny forced aligner comes with the embedded model
        assert status == 200 and health["status"] == "healthy" and health["aligner"]["ready"] is True
        # the playground and the files it loads, from the package data
        status, headers, page = request(server.url + "/")
        assert status == 200 and headers["Content-Type"].startswith("text/html") and b"playground.js" in page
        status, headers, script = request(server.url + "/playground/playground.js")
        assert status == 200 and headers["Content-Type"].startswith("text/javascript") and b"import" in script
    finally:
        output = server.stop()
    assert " ready: serving " in output and str(REPO) not in output
    assert "the embedded tiny model has random weights: it speaks noise" in output
