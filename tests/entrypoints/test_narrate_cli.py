"""`omni-tts narrate` as a user runs it (real processes, the tiny CustomVoice fixture, greedy): the file is the
segments spoken one by one (the offline engine, in this process) plus the pauses; a run cut by Ctrl-C or killed
leaves a file its sidecar describes, and the same command completes it into the uninterrupted run's file; a killed
run leaves no shared memory and no warning; another input or other options are refused without --restart; every
bad input is one line and a non-zero exit.

A run is cut at a known state, not after a delay: the command runs under a wrapper that sends the signal itself
once the sidecar lists K segments and some bytes of the next one are in the file (the signal is real: Ctrl-C goes
to the whole process group, stages included, as a terminal sends it)."""
import io
import json
import os
import re
import signal
import subprocess
import sys
import wave

import av
import numpy as np
import pytest
import torch

from conftest import FIXTURES
from omni_tts.audio.pcm import to_int16
from omni_tts.engine.offline import synthesize
from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.sampling_params import SamplingParams
from omni_tts.orchestrator.narration import Pauses, plan_segments

MODEL = FIXTURES / "tiny-custom-voice"
SEED, SEGMENT_CHARS, SENTENCE_PAUSE_MS, PARAGRAPH_PAUSE_MS = 7, 60, 200, 600
OPTIONS = ["--model", str(MODEL), "--voice", "ryan", "--temperature", "0", "--max-new-tokens", "3", "--seed",
           str(SEED), "--segment-chars", str(SEGMENT_CHARS), "--sentence-pause-ms", str(SENTENCE_PAUSE_MS),
           "--paragraph-pause-ms", str(PARAGRAPH_PAUSE_MS), "--no-progress"]
TEXT = ("The river ran past the old mill. Travellers rested by the bridge. The sun was low over the hills.\n"
        "Birds sang in the green fields. A cart rolled by slowly. Its driver hummed an old song.\n\n"
        "Night came over the valley. Lamps were lit in every window. Dogs barked far away. The wind rose and fell. "
        "Somewhere a door closed.\n\n"
        "Morning brought fresh rain. The mill wheel turned again. Children ran to school. The baker opened his "
        "shop. Smoke rose from the chimneys. The travellers went on their way. Nobody saw them leave.")
CUT_AFTER = 3   # segments whole in the file when a run is cut
# the command, cut at a known state: once the sidecar lists CUT_AFTER segments and the next one's audio is being
# written, the wrapper sends `how` (argv[1]); the rest of argv is the command's
CUT = """
import os, signal, sys
from omni_tts.entrypoints.cli import main
from omni_tts.entrypoints.cli.narration_file import NarrationFile

write, how = NarrationFile.write, sys.argv[1]

def write_then_cut(self, audio):
    write(self, audio)
    if len(self.delivered) == {cut_after} and self.file.tell() > self.delivered[-1].bytes:
        if how == "ctrl-c":
            NarrationFile.write = write
            os.killpg(0, signal.SIGINT)
        else:
            self.file.flush()
            os.kill(os.getpid(), signal.SIGKILL)

NarrationFile.write = write_then_cut
sys.exit(main(sys.argv[2:]))
""".format(cut_after=CUT_AFTER)


def narrate(out, *extra: str, text: str = TEXT, cut: str | None = None) -> subprocess.CompletedProcess:
    """`omni-tts narrate - --out OUT` on `text` (stdin), in a process group of its own (Ctrl-C reaches its stages
    and nothing else)."""
    command = ["narrate", "-", "--out", str(out), *OPTIONS, *extra]
    prefix = [sys.executable, "-c", CUT, cut] if cut else [sys.executable, "-m", "omni_tts.entrypoints.cli"]
    return subprocess.run([*prefix, *command], input=text, capture_output=True, text=True, timeout=300,
                          start_new_session=True)


def sidecar(out) -> dict:
    return json.loads(open(f"{out}.narration.json").read())


def wav_samples(path) -> np.ndarray:
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SAMPLE_RATE)
        data = w.readframes(w.getnframes())
    assert len(data) == os.path.getsize(path) - 44   # the header states the whole length
    return np.frombuffer(data, np.int16)


@pytest.fixture(scope="module")
def expected() -> np.ndarray:
    """The narration by hand: each segment synthesized on its own by the offline engine with its seed, in the
    non-streaming layout, then the pause its boundary asks for."""
    tts = Qwen3TTS.from_pretrained(str(MODEL), device="cpu", dtype=torch.float32)
    segments = plan_segments(tts.prompts, TEXT, SEGMENT_CHARS)
    assert len(segments) > 2 * CUT_AFTER
    requests = [SynthesisRequest(text=s.text, voice="ryan", non_streaming_mode=True,
                                 sampling=SamplingParams(temperature=0, max_new_tokens=3, seed=SEED + s.index))
                for s in segments]
    pauses = Pauses(SENTENCE_PAUSE_MS / 1000, PARAGRAPH_PAUSE_MS / 1000)
    pieces = []
    for segment, result in zip(segments, synthesize(tts, requests)):
        pause = 0 if segment is segments[-1] else round(pauses.after(segment) * SAMPLE_RATE)
        pieces += [result.audio, np.zeros(pause, np.float32)]
    return to_int16(np.concatenate(pieces))


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> bytes:
    """An uninterrupted run's WAV file."""
    out = tmp_path_factory.mktemp("whole") / "book.wav"
    result = narrate(out)
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith(f"wrote {out}: ") and result.stderr.count("\n") == 1, result.stderr
    assert not os.path.exists(f"{out}.narration.json")
    return out.read_bytes()


def assert_one_line_error(result: subprocess.CompletedProcess, status: int, message: str) -> None:
    assert result.returncode == status, (result.returncode, result.stderr)
    assert result.stderr.startswith("omni-tts narrate: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr, result.stderr


def test_the_file_is_the_segments_one_by_one_plus_the_pauses(whole, expected, tmp_path):
    path = tmp_path / "book.wav"
    path.write_bytes(whole)
    samples = wav_samples(path)
    assert samples.shape == expected.shape
    # the stages decode in chunks, the offline engine at once: the same audio within a float rounding
    assert np.abs(samples.astype(np.int32) - expected).max() <= 1


def assert_same_pcm(a: bytes, b: bytes) -> None:
    """16-bit samples equal but for a rounding: code2wav batches a narration's segments as their times happen to
    overlap, and a decoder call over other rows sums in another order (float32, ~1e-7), which int16 rounding can show
    as 1 LSB."""
    assert len(a) == len(b)
    assert np.abs(np.frombuffer(a, np.int16).astype(np.int32) - np.frombuffer(b, np.int16)).max(initial=0) <= 1


def test_ctrl_c_leaves_a_file_the_same_command_completes(whole, tmp_path):
    out = tmp_path / "book.wav"
    cut = narrate(out, cut="ctrl-c")
    assert cut.returncode == 130, cut.stderr
    assert "Traceback" not in cut.stderr and cut.stderr.endswith(
        f"interrupted after {CUT_AFTER} of {sidecar(out)['identity']['segments']} segments; the same command "
        "again resumes it\n"), cut.stderr
    listed = sidecar(out)["segments"]
    assert [s["index"] for s in listed] == list(range(CUT_AFTER))
    assert os.path.getsize(out) > listed[-1]["bytes"]   # some of the next segment, which the sidecar does not list
    assert_same_pcm(whole[44:listed[-1]["bytes"]], out.read_bytes()[44:listed[-1]["bytes"]])  # no length in the header
    offsets = [s["audio_offset"] for s in listed]
    assert offsets[0] == 0 and all(b > a for a, b in zip(offsets, offsets[1:]))

    resumed = narrate(out)
    assert resumed.returncode == 0, resumed.stderr
    assert f"({CUT_AFTER} of them from before)" in resumed.stderr
    assert out.read_bytes()[:44] == whole[:44]
    assert_same_pcm(out.read_bytes()[44:], whole[44:])
    assert not os.path.exists(f"{out}.narration.json")


def test_a_killed_run_leaves_no_shared_memory_and_no_warning(tmp_path):
    """kill -9 cannot clean up: its stages see their parent gone, remove its shared memory and exit, each saying
    so in one line; nothing else is written (no resource tracker warns of a "leaked" ring: none holds it)."""
    killed = narrate(tmp_path / "book.wav", cut="kill")
    assert killed.returncode == -signal.SIGKILL
    lines = killed.stderr.splitlines()   # read to its end: every process that held it has exited
    gone = [re.search(r"ERROR omni_tts\.stages\.common: \w+: the server process (\d+) is gone; exiting$", line)
            for line in lines]
    assert len(lines) == 2 and all(gone), killed.stderr
    pid = gone[0].group(1)
    assert [name for name in os.listdir("/dev/shm") if name.startswith(f"omni_tts_{pid}_")] == []


@pytest.mark.slow   # opt-in (--runslow): the suite stays near 10 minutes on 2 cores
def test_a_killed_mp3_run_resumes_into_one_stream_of_the_whole_length(expected, tmp_path):
    out = tmp_path / "book.mp3"
    killed = narrate(out, cut="kill")
    assert killed.returncode == -signal.SIGKILL
    listed = sidecar(out)["segments"]
    assert len(listed) == CUT_AFTER and os.path.getsize(out) > listed[-1]["bytes"]

    resumed = narrate(out)
    assert resumed.returncode == 0, resumed.stderr
    assert not os.path.exists(f"{out}.narration.json")
    with av.open(io.BytesIO(out.read_bytes())) as container:
        assert len(container.streams) == 1
        decoded = sum(frame.samples for frame in container.decode(audio=0))
    # a cut MP3 stream loses the encoder's look-ahead and the new one starts with its delay: milliseconds
    assert abs(decoded / SAMPLE_RATE - expected.shape[0] / SAMPLE_RATE) <= 0.2


@pytest.mark.slow   # opt-in (--runslow): the suite stays near 10 minutes on 2 cores
def test_another_input_or_other_options_need_restart(whole, tmp_path):
    out = tmp_path / "book.wav"
    assert narrate(out, cut="ctrl-c").returncode == 130
    partial, listed = out.read_bytes(), sidecar(out)
    changed_text = narrate(out, text=TEXT.replace("river", "stream"))
    assert_one_line_error(changed_text, 2, f"{out} is a partial narration of another input (text_sha256 changed); "
                                           "run with --restart to start it again")
    changed_pause = narrate(out, "--sentence-pause-ms", "300")
    assert_one_line_error(changed_pause, 2, "a partial narration of other options (sentence_pause_ms changed)")
    assert out.read_bytes() == partial and sidecar(out) == listed   # a refused run touches nothing

    restarted = narrate(out, "--sentence-pause-ms", "300", "--restart")
    assert restarted.returncode == 0, restarted.stderr
    assert "from before" not in restarted.stderr
    assert len(out.read_bytes()) > len(whole)   # longer pauses, from the start


@pytest.mark.slow   # opt-in (--runslow): the suite stays near 10 minutes on 2 cores
def test_a_cut_opus_narration_is_refused_not_resumed(tmp_path):
    out = tmp_path / "book.opus"
    assert narrate(out, cut="ctrl-c").returncode == 130
    again = narrate(out)
    assert_one_line_error(again, 2, f"{out} is a partial opus narration, which cannot be continued after a cut")
    assert "--restart" in again.stderr


@pytest.mark.parametrize("args,text,message", [
    (["--format", "wav"], "", "stdin holds no text to narrate"),
    ([], TEXT, "cannot tell the format from its extension"),
    (["--voice", "nobody"], TEXT, "--voice: unknown voice 'nobody'"),
    (["--language", "Klingon"], TEXT, "--language: unsupported language 'Klingon'"),
    (["--temperature", "-1"], TEXT, "temperature must be "),
    (["--segment-chars", "5"], TEXT, "--segment-chars must be >= 20"),
    (["--model", "/nonexistent/model"], TEXT, "/nonexistent/model"),
])
def test_bad_input_is_one_line(tmp_path, args, text, message):
    out = tmp_path / ("book.txt" if not args else "book.wav")
    result = narrate(out, *args, text=text)
    assert_one_line_error(result, 2, message)
    assert not os.path.exists(out)


def test_a_missing_file_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "omni_tts.entrypoints.cli", "narrate", str(tmp_path / "no.txt"),
                             "--out", str(tmp_path / "book.mp3")], capture_output=True, text=True, timeout=120)
    assert_one_line_error(result, 2, f"{tmp_path / 'no.txt'}: file not found")
