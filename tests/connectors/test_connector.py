"""Chunk connectors across real (spawned) processes: the shared-memory ring on real /dev/shm, TCP on real loopback
sockets. The behaviour both kinds promise is tested on both (`kind`); what only one has, on that one."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import pytest

from omni_tts.connectors import (ChunkReader, ChunkWriter, ConnectorSpec, RingOwner, TcpChunkReader, TcpChunkWriter,
                                 TcpOwner, TcpSpec, chunk_reader, chunk_writer, cleanup_stale_blocks)
from omni_tts.connectors.base import connect, unbounded_socket
from omni_tts.connectors.tcp import SECRET_ENV, curve_keys, writer_socket

CTX = mp.get_context("spawn")
NUM_CODEBOOKS = 16
WAIT_S = 20.0  # generous bound for any cross-process hand-off; tests normally take far less
KINDS = ["shm", "tcp"]


def create_owner(kind: str, num_slots: int, max_frames: int, edge: str = "ring") -> RingOwner | TcpOwner:
    if kind == "tcp":
        return TcpOwner.create(num_slots=num_slots, max_frames=max_frames)  # loopback, a port it picks
    return RingOwner.create(num_slots=num_slots, max_frames=max_frames, edge=edge)


def own_segments(pid: int | None = None) -> list[str]:
    prefix = f"omni_tts_{pid or os.getpid()}_"
    return [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


def traffic(seed: int, num_requests: int = 8) -> list[tuple[str, int, np.ndarray, bool, bool]]:
    """Interleaved chunks of `num_requests` requests: random F in 1..25, random codes; a
    context chunk first for some requests and a bare (F = 0) end marker for others."""
    rng = np.random.default_rng(seed)
    per_request: dict[str, list] = {}
    for r in range(num_requests):
        rid = f"req-{r}-é"  # non-ASCII: ids travel as UTF-8
        n = int(rng.integers(3, 10))
        chunks = [(rid, seq, rng.integers(-5, 2200, size=(int(rng.integers(1, 26)), NUM_CODEBOOKS)), False, False)
                  for seq in range(n)]
        if r % 3 == 0:
            rid_, seq, codes, _, _ = chunks[0]
            chunks[0] = (rid_, seq, codes, False, True)
        if r % 4 == 1:
            chunks.append((rid, n, np.zeros((0, NUM_CODEBOOKS), np.int64), True, False))
        else:
            rid_, seq, codes, _, ctx = chunks[-1]
            chunks[-1] = (rid_, seq, codes, True, ctx)
        per_request[rid] = chunks
    order = []
    while any(per_request.values()):  # random interleaving, each request's chunks in seq order
        live = [rid for rid, cs in per_request.items() if cs]
        order.append(per_request[live[int(rng.integers(len(live)))]].pop(0))
    return order


def digest(rid: str, seq: int, codes: np.ndarray, is_last: bool, is_context: bool) -> tuple:
    codes = np.ascontiguousarray(codes, dtype=np.int32)
    return rid, seq, codes.shape, is_last, is_context, hashlib.sha1(codes.tobytes()).hexdigest()


def cpu_seconds() -> float:
    """This process's user+system CPU time (all threads, incl. zmq's io thread)."""
    return time.process_time()


# ------------------------------------------------------------------ child process bodies


def writer_main(spec: ConnectorSpec, seed: int, results: mp.Queue) -> None:
    with chunk_writer(spec) as writer:
        for chunk in traffic(seed):
            writer.put(*chunk)
        assert writer.flush(WAIT_S)
        results.put(("writer", writer.stats()))


def reader_main(spec: ConnectorSpec, num_requests: int, results: mp.Queue) -> None:
    """Reads until every request's last chunk arrived; reports digests in arrival order."""
    rng = np.random.default_rng(1)
    got, done = [], set()
    with chunk_reader(spec) as reader:
        while len(done) < num_requests:
            batch = reader.get_all_nowait() or [reader.get(WAIT_S)]
            for chunk in batch:
                assert chunk is not None, "timed out waiting for a chunk"
                assert not chunk.codes.flags.writeable
                got.append(digest(chunk.request_id, chunk.seq, chunk.codes, chunk.is_last, chunk.is_context))
                if chunk.is_last:
                    done.add(chunk.request_id)
                if rng.random() < 0.2:
                    time.sleep(0.002)  # a slow consumer now and then: exercises slot reuse
                reader.release(chunk)
        assert reader.get(0.2) is None, "chunks after every request finished"
    results.put(("reader", got))


def holding_reader_main(spec: ConnectorSpec, expected: int, release_now: mp.Event, results: mp.Queue) -> None:
    """Takes every slot and holds it until `release_now`; then reads the rest normally."""
    with chunk_reader(spec) as reader:
        held = [reader.get(WAIT_S) for _ in range(spec.num_slots)]
        assert all(c is not None for c in held)
        results.put(("holding", len(held)))
        assert release_now.wait(WAIT_S)
        got = [digest(c.request_id, c.seq, c.codes, c.is_last, c.is_context) for c in held]
        for c in held:
            reader.release(c)
        while len(got) < expected:
            c = reader.get(WAIT_S)
            assert c is not None
            got.append(digest(c.request_id, c.seq, c.codes, c.is_last, c.is_context))
            reader.release(c)
    results.put(("reader", got))


def idle_main(role: str, spec: ConnectorSpec, go_idle: mp.Event, results: mp.Queue) -> None:
    """Exchanges a few chunks, then reports CPU used over ~1 s of idleness."""
    if role == "writer":
        with chunk_writer(spec) as writer:
            for seq in range(5):
                writer.put("r", seq, np.ones((2, NUM_CODEBOOKS), np.int32), is_last=seq == 4)
            assert writer.flush(WAIT_S)
            assert go_idle.wait(WAIT_S)
            cpu0, wall0 = cpu_seconds(), time.monotonic()
            time.sleep(1.0)  # a window to measure over (engine idle; the save/release threads are blocked)
            results.put((role, (cpu_seconds() - cpu0) / (time.monotonic() - wall0)))
    else:
        with chunk_reader(spec) as reader:
            for _ in range(5):
                reader.release(reader.get(WAIT_S))
            go_idle.set()
            cpu0, wall0 = cpu_seconds(), time.monotonic()
            assert reader.get(timeout=1.0) is None  # the consumer blocked in get(), as in the engine loop
            results.put((role, (cpu_seconds() - cpu0) / (time.monotonic() - wall0)))


def noop() -> None:
    pass


# ------------------------------------------------------------------ fixtures / helpers


@pytest.fixture
def procs():
    started: list[mp.Process] = []

    def spawn(target, *args) -> mp.Process:
        p = CTX.Process(target=target, args=args, daemon=True)
        p.start()
        started.append(p)
        return p

    yield spawn
    for p in started:
        if p.is_alive():
            p.kill()
        p.join(5)


def collect(results: mp.Queue, n: int) -> dict:
    out = {}
    for _ in range(n):
        item = results.get(timeout=WAIT_S)
        out[item[0]] = item[1:] if len(item) > 2 else item[1]
    return out


def assert_exited_ok(*ps: mp.Process) -> None:
    for p in ps:
        p.join(WAIT_S)
        assert p.exitcode == 0, f"{p.name} exit code {p.exitcode}"


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("kind", KINDS)
def test_interleaved_requests_arrive_intact_and_in_order(procs, kind):
    seed = 1234
    with create_owner(kind, num_slots=8, max_frames=25, edge="t1") as owner:
        results = CTX.Queue()
        # The writer starts first: notifications queue until the reader binds.
        w = procs(writer_main, owner.spec, seed, results)
        r = procs(reader_main, owner.spec, 8, results)
        out = collect(results, 2)
        assert_exited_ok(w, r)
    sent = [digest(*c) for c in traffic(seed)]
    got = out["reader"]
    assert len(got) == len(sent) and sorted(got) == sorted(sent)  # none lost, none duplicated, all equal
    for rid in {d[0] for d in sent}:  # per request: exactly the sent sequence, in order
        assert [d for d in got if d[0] == rid] == [d for d in sent if d[0] == rid]
    stats = out["writer"]
    assert stats.chunks_written == len(sent) and stats.pending == 0


@pytest.mark.parametrize("kind", KINDS)
def test_back_pressure_never_blocks_put_and_loses_nothing(procs, kind):
    n = 20
    chunks = [(f"bp-{i % 3}", i // 3, np.full((1 + i % 25, NUM_CODEBOOKS), i), i >= n - 3, False) for i in range(n)]
    with create_owner(kind, num_slots=4, max_frames=25, edge="t2") as owner, chunk_writer(owner.spec) as writer:
        for c in chunks:  # all puts happen before the reader even exists: a put waiting for a slot would hang here
            writer.put(*c)

        results, release_now = CTX.Queue(), CTX.Event()
        r = procs(holding_reader_main, owner.spec, n, release_now, results)
        assert results.get(timeout=WAIT_S) == ("holding", 4)
        # the sender met every slot held (a stall) and wrote no 5th chunk: it does not reuse a slot the reader holds
        stats = writer.stats()
        assert (stats.chunks_written, stats.slots_in_use, stats.pending) == (4, 4, n - 4)
        assert stats.slot_stalls >= 1 and n - 4 <= stats.max_queued <= n  # the sender may take 4 during the puts
        writer.put("late", 0, np.zeros((1, NUM_CODEBOOKS), np.int32), is_last=True)  # still non-blocking: queued
        assert writer.stats().pending == n - 4 + 1
        chunks.append(("late", 0, np.zeros((1, NUM_CODEBOOKS), np.int32), True, False))

        release_now.set()
        # reader_main stops after `n`; read the late one's delivery from the writer's side.
        assert writer.flush(WAIT_S)
        got = collect(results, 1)["reader"]
        assert_exited_ok(r)
    assert got == [digest(*c) for c in chunks[:n]]
    assert writer.stats().chunks_written == n + 1


def test_spec_picks_the_kind():
    with create_owner("shm", 2, 4) as ring, create_owner("tcp", 2, 4) as tcp:
        assert type(chunk_writer(ring.spec)) is ChunkWriter and type(chunk_reader(ring.spec)) is ChunkReader
        assert type(chunk_writer(tcp.spec)) is TcpChunkWriter and type(chunk_reader(tcp.spec)) is TcpChunkReader
        for spec in (ring.spec, tcp.spec):  # as the launch message carries it
            assert msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=ConnectorSpec) == spec


def test_shutdown_leaves_no_segments_and_stale_cleanup(procs, tmp_path):
    others = set(own_segments())   # this process's other pipelines' (a session-scoped app may be running)
    owner = RingOwner.create(num_slots=2, max_frames=4, edge="t3")
    ipc_dir = os.path.dirname(owner.spec.notify_address[len("ipc://"):])
    try:
        assert os.path.isdir(ipc_dir) and owner.spec.name in own_segments()
        # A stage attaches and closes: it must not unlink (only the owner does).
        reader = ChunkReader(owner.spec)
        reader.start()
        reader.close()
        reader.close()
        assert owner.spec.name in own_segments()
        # Same from an unrelated process with its own resource tracker (stage started by
        # subprocess, not multiprocessing): on 3.11/3.12 a tracked attach would unlink on exit.
        code = ("import sys, msgspec; from omni_tts.connectors import ChunkWriter, RingSpec; "
                "w = ChunkWriter(msgspec.json.decode(sys.argv[1], type=RingSpec)); w.start(); w.close()")
        proc = subprocess.run([sys.executable, "-c", code, msgspec.json.encode(owner.spec).decode()],
                              capture_output=True, text=True, timeout=WAIT_S)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert owner.spec.name in own_segments()
    finally:
        owner.close()
    owner.close()  # idempotent
    assert set(own_segments()) == others and not os.path.exists(ipc_dir)

    dead = procs(noop)
    dead.join(WAIT_S)
    dead_seg, live_seg = f"omni_tts_{dead.pid}_stale_test", f"omni_tts_{os.getpid()}_live_test"
    dead_dir = tmp_path / f"omni_tts_{dead.pid}_ipc"
    for name in (dead_seg, live_seg):
        os.close(os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600))
    dead_dir.mkdir()
    try:
        removed = cleanup_stale_blocks(ipc_root=str(tmp_path))
        assert f"/dev/shm/{dead_seg}" in removed and str(dead_dir) in removed
        assert not os.path.exists(f"/dev/shm/{dead_seg}") and not dead_dir.exists()
        assert os.path.exists(f"/dev/shm/{live_seg}")
    finally:
        for name in (dead_seg, live_seg):
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("kind", KINDS)
def test_sigkilled_reader_does_not_hang_writer_close(procs, kind):
    with create_owner(kind, num_slots=4, max_frames=25, edge="t4") as owner:
        writer = chunk_writer(owner.spec)
        writer.start()
        for seq in range(10):
            writer.put("k", seq, np.ones((3, NUM_CODEBOOKS), np.int32), is_last=seq == 9)
        results, release_now = CTX.Queue(), CTX.Event()
        r = procs(holding_reader_main, owner.spec, 10, release_now, results)
        assert results.get(timeout=WAIT_S)[0] == "holding"  # the reader holds every slot
        os.kill(r.pid, signal.SIGKILL)
        r.join(WAIT_S)
        writer.put("k2", 0, np.ones((1, NUM_CODEBOOKS), np.int32), is_last=True)  # save thread stuck on slots
        closing = threading.Thread(target=writer.close)
        closing.start()
        closing.join(WAIT_S)
        assert not closing.is_alive(), "close() hangs on a save thread waiting for slots"
        assert all(not t.is_alive() for t in writer._threads)
        writer.close()


@pytest.mark.parametrize("kind", KINDS)
def test_idle_cpu_is_near_zero(procs, kind):
    with create_owner(kind, num_slots=4, max_frames=25, edge="t5") as owner:
        results, go_idle = CTX.Queue(), CTX.Event()
        w = procs(idle_main, "writer", owner.spec, go_idle, results)
        r = procs(idle_main, "reader", owner.spec, go_idle, results)
        out = collect(results, 2)
        assert_exited_ok(w, r)
    assert out["writer"] < 0.05 and out["reader"] < 0.05, out


def test_unreadable_chunk_frees_its_slot_and_is_reported():
    """A corrupt header: the chunk is not handed on, its slot goes back to the writer (here a bare socket in the
    writer's place, to see the release), and the owner is told: the stage then fails and restarts rather than
    leave that chunk's request waiting forever."""
    import mmap
    import struct
    import threading

    import _posixshmem
    import zmq

    with RingOwner.create(num_slots=4, max_frames=4) as owner, zmq.Context() as ctx:
        spec = owner.spec
        releases = ctx.socket(zmq.PULL)
        releases.bind(spec.release_address)
        notify = ctx.socket(zmq.PUSH)
        notify.connect(spec.notify_address)
        errors, reported = [], threading.Event()

        def on_error(e: BaseException) -> None:
            errors.append(e)
            reported.set()
        with ChunkReader(spec, on_error=on_error) as reader:
            slot = 2
            fd = _posixshmem.shm_open("/" + spec.name, os.O_RDWR, mode=0o600)
            with mmap.mmap(fd, spec.total_bytes) as mm:
                struct.pack_into("<I", mm, slot * spec.slot_bytes + 16, 0xFFFFFFFF)  # num_frames > max_frames
            os.close(fd)
            notify.send(struct.pack("<I", slot))
            assert reported.wait(5) and "corrupt header" in str(errors[0])
            assert releases.poll(5000) and struct.unpack("<I", releases.recv()) == (slot,)
            assert reader.get(timeout=0.2) is None and reader.stats().slots_held == 0
        releases.close(linger=0)
        notify.close(linger=0)


def test_tcp_port_is_held_from_the_owner_until_its_close():
    """The owner's picked port: nobody else can bind it while the owner holds it, the reader (whose listener shares
    it) can, a second reader cannot, and it is free again once both let go."""
    import socket

    import zmq

    def bindable(port: int) -> bool:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
            return True

    owner = TcpOwner.create(num_slots=2, max_frames=4)
    spec = owner.spec
    assert spec.address == f"tcp://127.0.0.1:{spec.port}" and spec.port > 0
    assert not bindable(spec.port)
    reader = chunk_reader(spec)
    reader.start()
    try:
        with pytest.raises(zmq.ZMQError, match="Address already in use"):
            chunk_reader(spec).start()
    finally:
        reader.close()
        owner.close()
    owner.close()  # idempotent
    assert bindable(spec.port)
    assert TcpSpec(host="::1", port=7100, num_slots=1, max_frames=1, num_codebooks=1, secret="").address == (
        "tcp://[::1]:7100")
    with pytest.raises(ValueError, match="does not appear to be an IPv4 or IPv6 address"):
        TcpOwner.create(num_slots=2, max_frames=4, host="localhost")


def test_tcp_unreadable_message_frees_its_slot_and_is_reported():
    """A message the reader cannot read is never handed on: the slot its header names goes back to the writer (here
    a bare socket in the writer's place, to see the release) and the owner is told, so the stage fails and restarts
    rather than leave that chunk's request waiting forever. A message naming no slot is reported alone."""
    import struct
    import threading

    import zmq

    header = struct.Struct("<4sIqqII")  # the wire header, spelled out: the test pins the format
    with TcpOwner.create(num_slots=4, max_frames=4) as owner, zmq.Context() as ctx:
        spec = owner.spec
        writer = writer_socket(ctx, spec)
        errors, reported = [], threading.Semaphore(0)

        def on_error(e: BaseException) -> None:
            errors.append(e)
            reported.release()
        with chunk_reader(spec, on_error=on_error) as reader:
            good = np.arange(2 * NUM_CODEBOOKS, dtype="<i4").reshape(2, NUM_CODEBOOKS)
            writer.send_multipart([header.pack(b"otc1", 1, 7, 5, 2, 1) + "é".encode(), good.tobytes()])
            chunk = reader.get(WAIT_S)
            assert (chunk.request_id, chunk.seq, chunk.put_ns, chunk.slot, chunk.is_last, chunk.is_context) == (
                "é", 7, 5, 1, True, False)
            assert np.array_equal(chunk.codes, good) and not chunk.codes.flags.writeable
            reader.release(chunk)
            assert writer.poll(5000) and struct.unpack("<I", writer.recv()) == (1,)

            writer.send_multipart([header.pack(b"otc1", 2, 0, 0, 99, 0) + b"r", b""])  # more frames than max_frames
            assert reported.acquire(timeout=5) and "corrupt chunk header" in str(errors[-1])
            assert writer.poll(5000) and struct.unpack("<I", writer.recv()) == (2,)

            writer.send(b"not a chunk")
            assert reported.acquire(timeout=5) and "not a chunk message" in str(errors[-1])
            assert not writer.poll(200)  # it named no slot: nothing to give back
            assert reader.get(timeout=0.2) is None and reader.stats().slots_held == 0
        writer.close(linger=0)


HANDSHAKE_OUTCOMES = ("HANDSHAKE_SUCCEEDED", "HANDSHAKE_FAILED_NO_DETAIL", "HANDSHAKE_FAILED_PROTOCOL",
                      "HANDSHAKE_FAILED_AUTH")


def stray_peer(ctx, spec: TcpSpec, keys: str):
    """A DEALER that connects to the reader without the pipeline's secret, and its monitor (attached before the
    connect, so no handshake event is missed). `keys`: "none" (no CURVE), "wrong" (both key pairs from another
    secret) or "guessed" (the reader's public key, which a stray might learn, with a key pair of its own)."""
    import zmq

    sock = unbounded_socket(ctx, zmq.DEALER)
    if keys == "wrong":
        sock.curve_publickey, sock.curve_secretkey = curve_keys("0" * 64, "writer")
        sock.curve_serverkey = curve_keys("0" * 64, "reader")[0]
    elif keys == "guessed":
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
        sock.curve_serverkey = curve_keys(spec.secret, "reader")[0]
    monitor = sock.get_monitor_socket()
    return connect(sock, spec.address), monitor


def handshake_outcome(monitor) -> str:
    """How the peer's first handshake ended, as the zmq event name (waits for it: the reader may bind later)."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    outcomes = {getattr(zmq, f"EVENT_{name}"): name for name in HANDSHAKE_OUTCOMES}
    while monitor.poll(WAIT_S * 1000):
        event = recv_monitor_message(monitor)["event"]
        if event in outcomes:
            return outcomes[event]
    raise AssertionError("no handshake within WAIT_S")


def test_tcp_stray_peers_take_no_credits(procs):
    """Peers without the secret, connected before the talker's writer, never complete a handshake: they get no
    release (a credit) and send no chunk, so with 2 slots the writer's traffic (which needs its credits back again
    and again) all arrives intact. Before authentication, the reader's socket round-robined releases over them."""
    import zmq

    seed = 99
    with TcpOwner.create(num_slots=2, max_frames=25) as owner, zmq.Context() as ctx:
        results = CTX.Queue()
        r = procs(reader_main, owner.spec, 8, results)
        strays = [stray_peer(ctx, owner.spec, keys) for keys in ("none", "wrong", "guessed")]
        outcomes = [handshake_outcome(monitor) for _, monitor in strays]  # which failure zmq names varies with timing
        assert all(outcome.startswith("HANDSHAKE_FAILED") for outcome in outcomes), outcomes
        with chunk_writer(owner.spec) as writer:
            for chunk in traffic(seed):
                writer.put(*chunk)
            got = collect(results, 1)["reader"]
            assert writer.flush(WAIT_S)
        assert_exited_ok(r)
        assert [sock.poll(0) for sock, _ in strays] == [0, 0, 0]
        for sock, monitor in strays:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
    assert got == [digest(*c) for c in traffic(seed)]  # one writer, one connection: put order
    assert writer.stats().chunks_written == len(got)


def test_tcp_release_goes_back_to_the_connection_its_chunk_came_on():
    """Two authenticated senders: each slot's release goes to the one that sent the chunk in it (a round-robin over
    the peers would hand the second release to the wrong one)."""
    import struct

    import zmq

    header = struct.Struct("<4sIqqII")
    with TcpOwner.create(num_slots=4, max_frames=4) as owner, zmq.Context() as ctx:
        spec = owner.spec
        first, second = writer_socket(ctx, spec), writer_socket(ctx, spec)
        with chunk_reader(spec) as reader:
            for sock, slot in ((first, 0), (first, 1), (second, 2)):
                sock.send_multipart([header.pack(b"otc1", slot, 0, 0, 0, 1) + f"r{slot}".encode(), b""])
            chunks = sorted((reader.get(WAIT_S) for _ in range(3)), key=lambda c: c.slot)
            assert [c.request_id for c in chunks] == ["r0", "r1", "r2"]
            for chunk in chunks:
                reader.release(chunk)
            got = {name: [] for name in ("first", "second")}
            for name, sock, count in (("first", first, 2), ("second", second, 1)):
                while len(got[name]) < count and sock.poll(WAIT_S * 1000):
                    got[name].append(struct.unpack("<I", sock.recv())[0])
            assert got == {"first": [0, 1], "second": [2]}
            assert first.poll(0) == second.poll(0) == 0
        first.close(linger=0)
        second.close(linger=0)


def test_tcp_secret_is_per_pipeline_or_from_the_environment(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with TcpOwner.create(2, 4) as a, TcpOwner.create(2, 4) as b:
        assert len(a.spec.secret) == 64 and a.spec.secret != b.spec.secret
        assert a.spec.secret not in repr(a.spec)  # a logged spec never shows it
    monkeypatch.setenv(SECRET_ENV, "s" * 40)
    with TcpOwner.create(2, 4) as owner:
        assert owner.spec.secret == "s" * 40
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match=f"{SECRET_ENV}: at least 32 characters"):
        TcpOwner.create(2, 4)
