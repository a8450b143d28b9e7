"""The aligner stage batches spans of about one length (a batch pads to its longest prompt)."""
import collections

from omni_tts.stages.aligner_stage import _take_batch
from omni_tts.stages.messages import AlignSpan


def span(name: str, seconds: float) -> AlignSpan:
    return AlignSpan(name, 0, "text", None, b"\0" * (4 * int(seconds * 24000)), 24000)


def test_a_batch_takes_the_oldest_and_the_waiting_ones_of_about_its_length():
    pending = collections.deque(span(n, s) for n, s in [("a", 3), ("b", 10), ("c", 3.5), ("d", 30), ("e", 3.2),
                                                            ("f", 3.0)])
    assert [s.request_id for s in _take_batch(pending, 16)] == ["a", "c", "e", "f"]
    assert [s.request_id for s in pending] == ["b", "d"]   # the others keep their order
    assert [s.request_id for s in _take_batch(pending, 16)] == ["b"]
    pending = collections.deque(span(n, 2) for n in "pqrs")
    assert [s.request_id for s in _take_batch(pending, 3)] == ["p", "q", "r"]
    assert [s.request_id for s in pending] == ["s"]
