"""Replicas sharing one voices dir (voices/store.py): each replica is a VoiceStore of its own on the same directory —
in this process, where its lock and index are still its own, or in real processes racing each other. The HTTP
side (two servers on one dir) is in test_server.py, beside the server it reuses."""
import asyncio
import concurrent.futures
import contextlib
import fcntl
import json
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from omni_tts.voices import store as voices_module
from omni_tts.voices.store import CLOCK_FILE, LOCK_FILE, VoiceError, VoiceStore, VoiceStoreBackend
from omni_tts.models.qwen3_tts.audio import resampled_length
from test_voices import CLIP, CLIP_22K, CLIP_WAV, N_22K, age, files_under
from server_util import request
from test_server import GREEDY, MODEL, REF_TEXT, REF_WAV, post_voice, upload_voice
from waiting import eventually

LENGTHS = {24000: len(CLIP_WAV), 22050: resampled_length(N_22K, 22050)}  # samples of each clip at 24 kHz


def replicas(tmp_path, n=2, **kw) -> list[VoiceStore]:
    return [VoiceStore(str(tmp_path / "voices"), **kw) for _ in range(n)]


def test_a_replica_sees_the_others_uploads_replacements_and_deletes(tmp_path):
    a, b = replicas(tmp_path)
    assert isinstance(a, VoiceStoreBackend)
    first = a.add("Fox", CLIP, "The fox.", "yes")
    assert "fox" in b and [v.to_json() for v in b.list()] == [first.to_json()] and len(b) == 1
    record, samples = b.load("FOX")
    assert record == first
    np.testing.assert_array_equal(samples, CLIP_WAV)
    assert b.load("fox")[1] is samples  # unchanged meta.json: b's cached samples
    second = a.add("fox", CLIP_22K, None, None)
    record, samples = b.load("fox")
    assert record == second and record.created_at > first.created_at and samples.shape[0] == LENGTHS[22050]
    assert b.cache_info()["entries"] == 1  # the replaced version left b's cache
    assert a.delete("fox") == second
    assert "fox" not in b and b.load("fox") is None and b.list() == [] and len(b) == 0
    assert b.delete("fox") is None and b.cache_info()["entries"] == 0
    # and the other way round: b's upload over a name a knows
    a.add("owl", CLIP, None, None)
    a.load("owl")
    owl = b.add("OWL", CLIP_22K, "hoot", None)
    assert a.load("owl")[0] == owl and [v.name for v in a.list()] == ["OWL"]
    assert files_under(tmp_path / "voices") == [f"owl/{os.path.basename(owl.path)}", "owl/meta.json"]


def test_created_at_is_strictly_increasing_across_replicas_and_deletes(tmp_path, monkeypatch):
    """With the clock stopped, every upload through any replica still gets a later created_at — also one of a name
    deleted before, through a replica that never saw it: (name, created_at) is never reused for another clip."""
    clock = types.SimpleNamespace(time=lambda: 1_900_000_000.5, time_ns=time.time_ns)
    monkeypatch.setattr(voices_module, "time", clock)
    a, b = replicas(tmp_path)
    stamps = [a.add("v", CLIP, None, None).created_at, b.add("w", CLIP, None, None).created_at,
              a.add("w", CLIP, None, None).created_at]
    assert a.delete("v") and a.delete("w") and a.list() == []
    fresh = VoiceStore(a.root)  # restarted: no voice on disk tells it what came before
    stamps.append(fresh.add("v", CLIP, None, None).created_at)
    stamps.append(b.add("v", CLIP, None, None).created_at)
    assert stamps == list(range(1_900_000_000, 1_900_000_005))
    assert (tmp_path / "voices" / CLOCK_FILE).read_text() == "1900000004"


def test_limits_and_quota_count_every_replicas_voices(tmp_path):
    a, b = replicas(tmp_path, max_voices=3, quota_bytes=2 * len(CLIP) + 10)
    a.add("one", CLIP, None, None)
    b.add("two", CLIP, None, None)
    with pytest.raises(VoiceError, match="voice store is full") as error:
        a.add("three", CLIP_22K, None, None)
    assert error.value.status == 413
    b.add("ONE", CLIP, None, None)  # a replacement counts in place of the clip it replaces, whoever stored it
    assert a.delete("two") and b.add("three", CLIP, None, None)
    c, d = replicas(tmp_path / "limit", max_voices=2)
    c.add("x", CLIP, None, None)
    d.add("y", CLIP, None, None)
    with pytest.raises(VoiceError, match="voice limit reached") as error:
        c.add("z", CLIP, None, None)
    assert error.value.status == 409


@pytest.mark.parametrize("elsewhere", ["replace", "delete"])
def test_a_load_whose_clip_vanishes_looks_again(tmp_path, elsewhere):
    """Another replica replaces or deletes the voice between this load's meta.json read and its clip read: the load
    reads the version now current, or answers None — never an error, never a mix."""
    a, b = replicas(tmp_path)
    old = a.add("v", CLIP, None, None)
    looked_up = b._current

    def racing(key):
        record = looked_up(key)
        if record is not None and record.created_at == old.created_at:
            a.add("v", CLIP_22K, None, None) if elsewhere == "replace" else a.delete("v")
        return record

    b._current = racing
    loaded = b.load("v")
    if elsewhere == "delete":
        assert loaded is None
    else:
        record, samples = loaded
        assert record.created_at > old.created_at and samples.shape[0] == LENGTHS[22050]
    assert not os.path.exists(old.path)


def test_a_restarting_replica_leaves_young_files_and_clips_being_read(tmp_path):
    root = tmp_path / "voices"
    a, = replicas(tmp_path, n=1)
    voice = a.add("v", CLIP, None, None)
    age(voice.path)  # an old upload...
    with a._lock:    # ...that a load in replica a is reading when a deletes it
        a._pins[voice.path] += 1
    assert a.delete("v") and os.path.exists(voice.path)
    folder = root / "w"
    folder.mkdir()
    young = [folder / ".tmp-upload-in-flight", folder / "clip-1-00000000.wav", root / ".tmp-clock-in-flight"]
    old = [folder / ".tmp-crashed", folder / "clip-2-00000000.wav", root / ".tmp-clock-crashed"]
    for path in young + old:
        path.write_bytes(CLIP)
    age(*old)
    VoiceStore(str(root))  # another replica (re)starts: its sweep runs
    assert os.path.exists(voice.path) and all(p.exists() for p in young) and not any(p.exists() for p in old)
    a._unpin(voice.path)  # the read ends
    assert not os.path.exists(voice.path)
    age(*young)
    VoiceStore(str(root))
    assert files_under(root) == []


def test_replicas_in_real_processes_race_on_the_same_names(tmp_path):
    """Two processes upload, replace, delete, load and restart on the same three names at once. Afterwards the
    directory holds exactly whole voices — one meta.json and the one clip it names, per folder — and nothing else;
    every created_at was handed out once; every load got a record and the samples of that record's clip; each
    surviving voice is the newest upload of its name."""
    root, go = tmp_path / "voices", tmp_path / "go"
    VoiceStore(str(root))
    worker = Path(__file__).parent / "voice_race.py"
    procs = [subprocess.Popen([sys.executable, str(worker), str(root), str(go), str(seed), "60"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for seed in (1, 2)]

    def both_set_up() -> bool:
        for proc in procs:  # a worker that died says why at once, not after the wait's deadline
            assert proc.poll() is None, proc.communicate()[1].decode()[-3000:]
        return all(Path(f"{go}.ready-{seed}").exists() for seed in (1, 2))

    eventually(both_set_up, what="both replicas set up")
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err.decode()[-3000:]
        results.append(json.loads(out))
    assert [r["errors"] for r in results] == [[], []]
    adds = [tuple(a) for r in results for a in r["adds"]]
    assert len(adds) > 20 and len({created for _, created in adds}) == len(adds)
    for key, created, rate, length in (tuple(x) for r in results for x in r["loads"]):
        assert (key, created) in adds and LENGTHS[rate] == length
    after = VoiceStore(str(root))
    survivors = after.list()
    for voice in survivors:
        assert voice.created_at == max(created for key, created in adds if key == voice.key)
    expected = sorted(f"{v.key}/{name}" for v in survivors for name in (os.path.basename(v.path), "meta.json"))
    assert files_under(root) == expected
    for voice in survivors:
        assert os.path.getsize(voice.path) == voice.file_size
        assert after.load(voice.name)[1].shape[0] == LENGTHS[voice.sample_rate]
    assert sorted(os.listdir(root)) == sorted([LOCK_FILE, CLOCK_FILE] + [v.key for v in survivors])


def test_a_writer_waits_a_bounded_time_for_another_replicas_lock_and_reads_never_wait(tmp_path):
    """Another replica holds the directory: an upload gives up after lock_timeout (503: retry), a load reads on,
    and a load whose clip must be removed afterwards leaves it to a later sweep instead of waiting."""
    store = VoiceStore(str(tmp_path), lock_timeout=0.2)
    store.add("kept", CLIP, None, None)
    with other_replicas_lock(tmp_path):
        with pytest.raises(VoiceError, match="busy") as refused:
            store.add("new", CLIP, None, None)
        assert refused.value.status == 503
        record, samples = store.load("kept")
        assert samples.shape[0] == LENGTHS[record.sample_rate]
    assert store.add("new", CLIP, None, None).name == "new"  # the lock free again


@contextlib.contextmanager
def other_replicas_lock(root):
    """The voices directory's lock, held as another replica's writer would hold it."""
    with open(os.path.join(root, LOCK_FILE), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def test_uploads_waiting_on_the_lock_are_bounded_and_hold_up_no_speech(base_server):
    """While another replica holds the lock: uploads wait (one writer thread), at most 8 admitted and the rest 429 at
    once; a speech request with an uploaded voice (its mp3 encoded meanwhile) and a listing are answered meanwhile
    (reads and encoders have their own threads); the waiting uploads finish once the lock is free."""
    upload_voice(base_server, "held-up-speaker", REF_WAV.read_bytes(), ref_text=REF_TEXT)
    speech = dict(model=MODEL, input="While uploads wait.", voice="held-up-speaker", response_format="mp3",
                  stream_format="audio", **GREEDY)
    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        with other_replicas_lock(base_server.voices_dir):
            uploads = [pool.submit(post_voice, base_server, f"waiting-{i}", REF_WAV.read_bytes(), ref_text=REF_TEXT)
                       for i in range(12)]
            eventually(lambda: sum(u.done() for u in uploads) == 4, what="4 uploads refused at once")
            refused = [json.loads(u.result()[1]) for u in uploads if u.done()]
            assert all(u.result()[0] == 429 for u in uploads if u.done()) and all(
                "waiting already" in r["error"]["message"] for r in refused)
            status, _, audio = request(base_server.url + "/v1/audio/speech", speech)
            assert status == 200 and audio[:3] in (b"ID3", b"\xff\xfb", b"\xff\xf3")
            status, _, listing = request(base_server.url + "/v1/audio/voices")
            assert status == 200 and "held-up-speaker" in json.loads(listing)["voices"]
            assert sum(u.done() for u in uploads) == 4  # the admitted ones still wait for the lock
        answers = [u.result() for u in uploads]
    # the admitted ones end once the lock is free, or, on a machine slow enough that the lock outlived a writer's
    # 10 s wait, with a 503 that says to retry: bounded either way
    admitted = [(status, body) for status, body in answers if status != 429]
    assert len(admitted) == 8 and all(status == 200 or (status == 503 and b"busy" in body)
                                      for status, body in admitted), admitted
    assert any(status == 200 for status, _ in admitted)   # those that waited after the lock was freed got in
    for i in range(12):
        request(base_server.url + f"/v1/audio/voices/waiting-{i}", method="DELETE")
    request(base_server.url + "/v1/audio/voices/held-up-speaker", method="DELETE")


class _SlowDisk:
    """A voice store on a file system whose lookups hang (an NFS server gone quiet) until `answer` is set."""

    def __init__(self) -> None:
        self.answer, self.asked = threading.Event(), threading.Event()

    def __contains__(self, name: object) -> bool:
        self.asked.set()
        self.answer.wait(10)
        return False


@pytest.mark.asyncio(loop_scope="session")
async def test_a_voice_lookup_that_hangs_holds_a_pool_thread_not_the_event_loop(in_process_app, monkeypatch):
    """Whether a request's voice is an uploaded one is asked of the store in its read pool: while the store's lookup
    hangs, the server answers /health (the lookup ran on the event loop, stalling every connection with it)."""
    import aiohttp

    url, state = in_process_app
    disk = _SlowDisk()
    monkeypatch.setattr(state, "voices", disk)
    async with aiohttp.ClientSession() as http:
        speech = asyncio.ensure_future(http.post(url + "/v1/audio/speech", json={"input": "Hi.", "voice": "someone"}))
        await asyncio.get_running_loop().run_in_executor(None, disk.asked.wait, 30)
        async with http.get(url + "/health") as health:
            assert health.status == 200 and not disk.answer.is_set()   # answered while the lookup hangs
        disk.answer.set()
        async with await speech as answer:
            assert answer.status == 400   # a CustomVoice model: no speaker 'someone'
