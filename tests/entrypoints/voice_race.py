"""One replica of a voice store in a race (tests/entrypoints/test_shared_voices.py): `python voice_race.py ROOT GO SEED OPS`
writes GO.ready-SEED once it is set up, waits for the file GO, then runs OPS random uploads, deletes, loads and
restarts on a few shared names, and prints what it saw as JSON. Its own process, so it imports no torch (and no
conftest)."""
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from omni_tts.voices.store import VoiceError, VoiceStore  # noqa: E402
from waiting import eventually  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_tts"
CLIPS = [(FIXTURES / "ref_voice.wav").read_bytes(), (FIXTURES / "ref_voice_22k.wav").read_bytes()]
NAMES = ["a", "B", "c"]


def main(root: str, go: str, seed: int, ops: int) -> dict:
    rng = random.Random(seed)
    store = VoiceStore(root)
    seen: dict = {"adds": [], "loads": [], "errors": []}
    Path(f"{go}.ready-{seed}").touch()
    eventually(lambda: os.path.exists(go), what="the go file", interval=0.001)  # both start within a millisecond
    for _ in range(ops):
        name, op = rng.choice(NAMES), rng.choice(["add", "add", "delete", "load", "load", "restart"])
        try:
            if op == "add":
                record = store.add(name, rng.choice(CLIPS), None, None)
                seen["adds"].append([record.key, record.created_at])
            elif op == "delete":
                store.delete(name)
            elif op == "load" and (loaded := store.load(name)) is not None:
                record, samples = loaded
                seen["loads"].append([record.key, record.created_at, record.sample_rate, int(samples.shape[0])])
            elif op == "restart":  # a replica starting beside the others: its sweep runs
                store = VoiceStore(root)
        except VoiceError as e:
            seen["errors"].append(f"{op} {name}: {e} ({e.status})")
    return seen


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))
