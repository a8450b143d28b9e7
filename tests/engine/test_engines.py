"""Talker engine (continuous batching) + chunker + code2wav engine, in one process: equal to offline synthesize."""
import functools

import numpy as np
import pytest

from conftest import FIXTURES, GOLDEN_CASES, case_requests
from omni_tts.config.chunk_schedule import doubling_frames
from omni_tts.config.stage_config import ConnectorConfig
from omni_tts.engine.chunker import FrameChunker
from omni_tts.engine.code2wav_engine import CodecChunk, Code2WavEngine
from omni_tts.engine.offline import prepare, synthesize
from omni_tts.engine.talker_engine import TalkerEngine, TalkerRequest
from omni_tts.models.qwen3_tts.model import Qwen3TTS
from omni_tts.models.qwen3_tts.prompt import SynthesisRequest
from omni_tts.models.qwen3_tts.sampling import SamplingParams

_models = {}


def model(variant):
    if variant not in _models:
        _models[variant] = Qwen3TTS.from_pretrained(str(FIXTURES / variant))
    return _models[variant]


def run_pipeline(tts, requests, chunk_frames=doubling_frames(2, 25), max_batch=8, prefill_budget=512, stagger=0,
                 abort_after=None, code2wav_frames=7):
    """Drive both engines step by step; request i joins at step i*stagger. Returns {rid: (codes, audio, reason)}.
    code2wav_frames: the decoder's frame budget per step (7 splits the 25-frame chunks)."""
    talker = TalkerEngine(tts.talker, tts.config, max_batch, 1024, prefill_budget, 512)
    code2wav = Code2WavEngine(tts.decoder, max_batch, code2wav_frames)
    prepared = [prepare(tts, r) for r in requests]
    frames, audio, reasons, chunkers = {}, {}, {}, {}
    pending = list(enumerate(prepared))
    step = 0
    while pending or talker.has_work() or code2wav.has_work():
        while pending and pending[0][0] * stagger <= step:
            i, p = pending.pop(0)
            rid = f"r{i}"
            talker.add_request(TalkerRequest(rid, p.prefill, p.trailing, p.sampling, p.max_tokens))
            code2wav.add_request(rid)
            frames[rid], audio[rid], chunkers[rid] = [], [], FrameChunker(chunk_frames)
            if p.prompt.ref_codes is not None:
                code2wav.add_chunk(rid, CodecChunk(p.prompt.ref_codes.numpy(), is_context=True))
        if abort_after and step in abort_after:
            for rid in abort_after[step]:
                talker.abort(rid)
                code2wav.abort(rid)
                reasons[rid] = "abort"
        for out in talker.step():
            if out.frame is not None:
                frames[out.request_id].append(out.frame)
            chunk_codes = chunkers[out.request_id].add(out.frame, out.finished)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
            if chunk_codes is not None:
                code2wav.add_chunk(out.request_id, CodecChunk(chunk_codes, is_last=out.finished))
        for out in code2wav.step():
            audio[out.request_id].append(out.audio)
        step += 1
    return {rid: (np.array(frames[rid]).reshape(-1, 16), np.concatenate(audio[rid]) if audio[rid] else np.zeros(0),
                  reasons.get(rid)) for rid in frames}, talker, code2wav


@functools.cache
def golden_requests_offline(variant: str) -> tuple[list[SynthesisRequest], list]:
    """Up to 6 of the variant's golden requests and their offline results (the same for every chunk size)."""
    cases = [c for c in GOLDEN_CASES if c["variant"] == variant]
    requests = [r for c in cases for r in case_requests(c)][:6]
    return requests, synthesize(model(variant), requests)


@pytest.mark.parametrize("initial", [1, 2, 25])
@pytest.mark.parametrize("variant", ["tiny-custom-voice", "tiny-voice-design", "tiny-base"])
def test_engines_equal_offline(variant, initial):
    tts = model(variant)
    requests, offline = golden_requests_offline(variant)
    out, talker, code2wav = run_pipeline(tts, requests, chunk_frames=doubling_frames(initial, 25), stagger=3)
    for i, expected in enumerate(offline):
        codes, audio, reason = out[f"r{i}"]
        np.testing.assert_array_equal(codes, expected.codes)
        assert reason == expected.finish_reason
        assert audio.shape == expected.audio.shape
        np.testing.assert_allclose(audio, expected.audio, atol=1e-5, rtol=0)
    assert talker.stats().num_running == 0 and not code2wav.requests


def test_small_batch_limit_queues_and_aborts_free_rows():
    tts = model("tiny-custom-voice")
    requests = [SynthesisRequest(text=f"Request number {i} says hello.", voice=v, sampling=SamplingParams(
        temperature=0.9 if i % 2 else 0, seed=i, max_new_tokens=30)) for i, v in
        enumerate(["ryan", "vivian", "serena", "aiden", "sohee", "eric"])]
    offline = [synthesize(tts, [r])[0] for r in requests]
    out, talker, code2wav = run_pipeline(tts, requests, max_batch=2, prefill_budget=1, abort_after={4: ["r3"]},
                                         code2wav_frames=None)
    for i, expected in enumerate(offline):
        codes, audio, reason = out[f"r{i}"]
        if i == 3:
            assert reason == "abort"
            continue
        np.testing.assert_array_equal(codes, expected.codes)
        np.testing.assert_allclose(audio, expected.audio, atol=1e-5, rtol=0)
    assert talker.stats().num_running == 0 and not code2wav.requests


def chunk_sizes(chunker: FrameChunker, frames: int) -> list[int]:
    """The chunk sizes `frames` frames give, the request ending with the last one."""
    sizes = []
    for i in range(frames):
        chunk = chunker.add(np.full(16, i), finished=i == frames - 1)
        if chunk is not None:
            sizes.append(chunk.shape[0])
    if frames == 0:
        sizes.append(chunker.add(None, finished=True).shape[0])
    return sizes


DOUBLING = dict(initial_codec_chunk_frames=1, codec_chunk_frames=25)


@pytest.mark.parametrize("config,first,num_requests,frames,expected", [
    (DOUBLING, None, 0, 60, [1, 2, 4, 8, 16, 25, 4]),   # no schedule: doubling from the first, capped at the size
    ({}, None, 0, 30, [2, 4, 8, 16]),                   # (2, 25) by default; the request ends mid-chunk: the
                                                        # remainder goes with the last frame
    ({}, 30, 0, 80, [30, 25, 25]),                      # a request's first chunk above the size: the size after it
    (DOUBLING, 3, 0, 20, [3, 6, 11]),                   # a request's first chunk: the doubling starts from it
    (dict(chunk_schedule="latency"), None, 0, 40, [1, 2, 4, 8, 12, 12, 1]),
    (dict(chunk_schedule="load"), None, 0, 70, [4, 4, 8, 16, 25, 13]),
    (dict(chunk_schedule="load"), 1, 0, 20, [1, 4, 8, 7]),   # the request's own first chunk wins, the rest stays
    (dict(chunk_schedule=[3, 5]), None, 0, 16, [3, 5, 5, 3]),
    (dict(chunk_schedule=[6]), 2, 0, 10, [2, 6, 2]),
    (dict(chunk_schedule="auto"), None, 7, 20, [1, 2, 4, 8, 5]),   # fewer than auto_load_requests (8): latency
    (dict(chunk_schedule="auto"), None, 8, 20, [4, 4, 8, 4]),      # from 8 requests in the talker on: load
    (dict(chunk_schedule="auto", auto_load_requests=2), None, 2, 8, [4, 4]),
    (DOUBLING, None, 0, 0, [0]),                         # ends without a frame: a bare end marker
])
def test_chunks_follow_the_schedule(config, first, num_requests, frames, expected):
    chunker = FrameChunker(ConnectorConfig(**config).chunk_frames(first, num_requests))
    assert chunk_sizes(chunker, frames) == expected
