"""The decoder's static-shape path (what CUDA graphs replay: bucketed rows, captured frame sizes, fixed buffers) run
eagerly on the CPU, against the dynamic decoder."""
import numpy as np
import pytest
import torch

from conftest import FIXTURES, load_component
from omni_tts.engine.code2wav_engine import Code2WavEngine
from omni_tts.engine.code2wav_runner import FRAME_SIZES, Code2WavRunner, frame_pieces
from omni_tts.models.qwen3_tts.checkpoint_config import SpeechTokenizerConfig
from omni_tts.models.qwen3_tts.speech_decoder import SpeechDecoder

# the goldens' tolerance for the decoder alone (tests/fixtures/qwen3_tts/README.md)
DECODER_ATOL = 5e-6


@pytest.fixture(scope="module")
def decoder() -> SpeechDecoder:
    variant = FIXTURES / "tiny-custom-voice"
    cfg = SpeechTokenizerConfig.load(str(variant)).decoder
    return load_component(lambda: SpeechDecoder(cfg), variant / "speech_tokenizer", "decoder.")


def test_frame_pieces_are_captured_sizes_summing_to_the_frames():
    assert frame_pieces(25) == [25] and frame_pieces(7) == [6, 1] and frame_pieces(40) == [25, 12, 3]
    for frames in range(1, 80):
        pieces = frame_pieces(frames)
        assert sum(pieces) == frames and set(pieces) <= set(FRAME_SIZES) and pieces == sorted(pieces, reverse=True)


@pytest.mark.parametrize("frames", [*FRAME_SIZES, 7, 40])
def test_static_runner_equals_the_dynamic_decoder(decoder, frames):
    """Every frame size (and two that split), first chunks (fresh slots) then steady chunks, at row counts that
    fill a bucket and that pad one; streams at different offsets share a call."""
    rng = np.random.default_rng(frames)
    static = Code2WavRunner(decoder, max_rows=8, capacity=4, static_shapes=True)   # the pool grows to 16
    for num_rows in (1, 3, 8):
        slots = [static.allocate() for _ in range(num_rows)]
        lead = [int(rng.integers(0, 4)) for _ in range(num_rows)]   # a head start: rows at different offsets
        codes = [rng.integers(0, decoder.cfg.codebook_size, (lead[i] + 2 * frames, 16)) for i in range(num_rows)]
        for i, slot in enumerate(slots):
            if lead[i]:
                static.decode([slot], codes[i][None, :lead[i]])
        first = static.decode(slots, np.stack([c[lead[i]:lead[i] + frames] for i, c in enumerate(codes)]))
        steady = static.decode(slots, np.stack([c[lead[i] + frames:] for i, c in enumerate(codes)]))
        for i, c in enumerate(codes):
            expected = decoder(torch.from_numpy(c.T[None]))[0].numpy()[lead[i] * decoder.samples_per_frame:]
            np.testing.assert_allclose(np.concatenate([first[i], steady[i]]), expected, atol=DECODER_ATOL, rtol=0)
        for slot in slots:
            static.release(slot)


def test_a_released_slot_starts_the_next_stream_from_silence(decoder):
    runner = Code2WavRunner(decoder, max_rows=2, capacity=1, static_shapes=True)
    rng = np.random.default_rng(1)
    codes = rng.integers(0, decoder.cfg.codebook_size, (1, 6, 16))
    slot = runner.allocate()
    alone = runner.decode([slot], codes)
    runner.release(slot)
    assert runner.allocate() == slot
    np.testing.assert_array_equal(runner.decode([slot], codes), alone)


def test_a_static_runner_takes_one_lane(decoder):
    with pytest.raises(ValueError, match="one lane"):
        Code2WavEngine(decoder, 4, lanes=2, runner=Code2WavRunner(decoder, 4, static_shapes=True))
