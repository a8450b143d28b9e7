"""The in-process connector of the fused layout (connectors/local.py): chunks in put order, the slots' bound and its
back-pressure, and a writer and a reader on two threads that move a whole traffic mix without loss or deadlock."""
from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from omni_tts.connectors.kinds import chunk_reader, chunk_writer, create_owner
from omni_tts.config import ConnectorConfig
from omni_tts.connectors.local import LocalSpec, local_pair
from test_connector import digest, traffic

SPEC = LocalSpec(num_slots=4, max_frames=25, num_codebooks=16)


def codes(value: int, frames: int = 3) -> np.ndarray:
    return np.full((frames, 16), value, np.int64)


def test_chunks_arrive_in_order_and_the_slots_bound_what_is_in_flight():
    writer, reader = local_pair(SPEC)
    for seq in range(6):
        writer.put("r", seq, codes(seq), is_last=seq == 5)
    first = reader.get_all_nowait()
    assert [c.seq for c in first] == [0, 1, 2, 3]  # 4 slots: two chunks wait in the writer
    assert writer.stats().pending == 2 and writer.stats().slot_stalls == 1
    assert not writer.flush(timeout=0)
    reader.release(first[0])  # a slot back: the next waiting chunk goes at once
    (fifth,) = reader.get_all_nowait()
    assert fifth.seq == 4 and (fifth.codes == 4).all() and not fifth.is_last
    for chunk in first[1:] + [fifth]:
        reader.release(chunk)
    (last,) = reader.get_all_nowait()
    assert last.seq == 5 and last.is_last and writer.flush(timeout=0)
    with pytest.raises(ValueError, match="not held"):
        reader.release(first[0])
    reader.release(last)
    assert writer.stats().slots_in_use == 0 and reader.stats().slots_held == 0


def test_a_writer_and_a_reader_on_two_threads_move_everything():
    expected = traffic(seed=7, num_requests=12)
    condition = threading.Condition()
    writer, reader = local_pair(SPEC, condition)
    received = []

    def consume():
        while len(received) < len(expected):
            with condition:
                condition.wait_for(lambda: reader.stats().queued > 0)
            for chunk in reader.get_all_nowait():
                received.append(digest(chunk.request_id, chunk.seq, chunk.codes, chunk.is_last, chunk.is_context))
                reader.release(chunk)

    consumer = threading.Thread(target=consume)
    consumer.start()
    for chunk in expected:
        writer.put(*chunk)
    consumer.join(timeout=30)
    assert not consumer.is_alive()
    assert received == [digest(*chunk) for chunk in expected]
    assert writer.flush(timeout=0) and writer.stats().slots_in_use == 0


def test_chunks_stay_in_put_order_under_back_pressure():
    """Two slots for thousands of chunks: the talker's put and code2wav's release each take chunks for the reader,
    on their own threads, and the one that took later can hand over first; delivery still keeps put order. (Thread
    switches made as frequent as they go: without the tickets, hundreds of chunks came out of order every run.)"""
    num_chunks = 20000
    condition = threading.Condition()
    writer, reader = local_pair(LocalSpec(num_slots=2, max_frames=1, num_codebooks=16), condition)
    one_frame = np.zeros((1, 16), np.int32)

    def produce():
        for seq in range(num_chunks):
            writer.put("r", seq, one_frame, is_last=seq == num_chunks - 1)

    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        producer = threading.Thread(target=produce)
        producer.start()
        received = []
        while len(received) < num_chunks:
            with condition:  # the loop's lock held while it takes and releases (a release hands chunks over)
                assert condition.wait_for(lambda: reader.stats().queued > 0, timeout=30)
                for chunk in reader.get_all_nowait():
                    received.append(chunk.seq)
                    reader.release(chunk)
        producer.join()
    finally:
        sys.setswitchinterval(switch_interval)
    assert received == list(range(num_chunks))


def test_the_ends_are_made_together_not_from_the_spec_alone():
    owner = create_owner(ConnectorConfig(kind="local", ring_slots=8), num_codebooks=16)
    assert owner.spec == LocalSpec(num_slots=8, max_frames=64, num_codebooks=16)
    for make in (chunk_writer, chunk_reader):
        with pytest.raises(ValueError, match="local_pair"):
            make(owner.spec)
    owner.close()
