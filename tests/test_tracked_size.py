"""A GPU device run sends the working tree and is refused above 64 MiB: the tracked files stay under 48 MiB. Each
fixture file is stored once; the tiny checkpoints that share a file (tokenizer, speech tokenizer, the talker of the
three CustomVoice/VoiceDesign ones) hold a relative link to tiny-custom-voice's copy."""
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
LIMIT_BYTES = 48 * 2 ** 20


def tracked_files() -> list[Path]:
    try:
        listing = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / name for name in listing.decode().split("\0") if name]


def test_tracked_files_stay_under_48_mib():
    total = sum(os.lstat(path).st_size for path in tracked_files() if os.path.lexists(path))
    assert total < LIMIT_BYTES, f"{total / 2 ** 20:.1f} MiB tracked"


def test_fixture_links_point_at_a_file_inside_the_fixtures():
    links = [path for path in tracked_files() if path.is_symlink()]
    assert links, "the tiny checkpoints share their common files through links"
    for link in links:
        assert not os.path.isabs(os.readlink(link)), link  # relative: the tree travels anywhere
        target = link.resolve()
        assert target.is_relative_to(FIXTURES) and target.is_file(), (link, target)
