"""Files in a directory that several processes share (the voice store's replicas): atomic replacement, one writer at
a time across processes, and a sweep of leftovers that cannot take a file another process still needs.

Needs of the file system: `rename` replaces atomically, and `flock` excludes across every process that opens the
lock file, on every host that mounts it (local file systems do; Linux NFS clients turn `flock` into a POSIX lock the
NFSv4 server arbitrates; a mount with `nolock` makes the lock host-local and is not fit for replicas on several
hosts). File times come from the file server's clock, so a sweep's grace period must exceed the clock skew between
the hosts. On NFS, mount with `lookupcache=positive` (or `none`): by default a client caches "no such file" for up to
the directory attribute-cache time (acdirmax, 60 s), and until then a file made through another host is unknown.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
import uuid
from typing import Callable, Iterator

TMP_PREFIX = ".tmp-"
LOCK_POLL_S = 0.01   # a writer waiting for the lock tries again this often


def fsync_dir(path: str) -> None:
    """Make renames and unlinks in `path` durable; best effort where directories cannot be opened or synced."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same folder, fsync, rename: readers see the old or the new
    content whole, never a part."""
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, f"{TMP_PREFIX}{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read_if_exists(path: str) -> bytes | None:
    """The file's bytes, or None when it (or a folder on its path) does not exist. Opening, not stat-ing, is what
    makes an NFS client revalidate against the server (close-to-open consistency)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None


class LockTimeout(Exception):
    """`exclusive` waited its whole timeout: another process holds the lock."""


@contextlib.contextmanager
def exclusive(lock_path: str, timeout: float, thread_lock: threading.Lock) -> Iterator[None]:
    """Hold `thread_lock` (this process's writers), then an exclusive lock on `lock_path` (created when missing)
    against every process, and every other open of the file in this one, that takes it too; LockTimeout after
    `timeout` seconds of waiting for both (flock itself has no timeout: it is tried every LOCK_POLL_S). Released
    when the block ends or the process dies."""
    deadline = time.monotonic() + timeout
    if not thread_lock.acquire(timeout=timeout):
        raise LockTimeout(f"{lock_path}: this process's writer held it for over {timeout:g} s")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeout(f"{lock_path} held by another process for over {timeout:g} s") from None
                time.sleep(LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # drops the lock
        thread_lock.release()


def touch(path: str) -> None:
    """Mark a file as in use now, for `remove_stale` in other processes; best effort."""
    try:
        os.utime(path)
    except OSError:
        pass


def remove_stale(folder: str, ours: Callable[[str], bool], keep: frozenset[str] | set[str], grace_s: float,
                 remove_folder: bool) -> list[str]:
    """Delete the files in `folder` that `ours(name)` claims, that are not in `keep`, and that were last modified more
    than `grace_s` ago: younger ones may be another process's write in progress or a clip it still reads. Then
    remove the folder when `remove_folder` and it is empty. Returns what could not be removed, with the reason."""
    failures = []
    try:
        names = os.listdir(folder)
    except OSError:
        return failures
    cutoff = time.time() - grace_s
    for name in names:
        if name in keep or not (name.startswith(TMP_PREFIX) or ours(name)):
            continue
        path = os.path.join(folder, name)
        try:
            if os.stat(path).st_mtime <= cutoff:
                os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            failures.append(f"{path}: {e}")
    if remove_folder:
        try:
            os.rmdir(folder)  # only when empty
        except OSError:
            pass
    return failures
