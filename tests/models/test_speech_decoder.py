"""Speech-tokenizer decoder: one-pass decode against the reference goldens, exact streaming, batching, loading."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import load_component
from omni_tts.models.qwen3_tts.model import SpeechTokenizerWeights
from omni_tts.models.qwen3_tts.random_model import randomize_speech_tokenizer
from omni_tts.models.qwen3_tts.weights import WeightsError, load_strict, read_tensors, safetensors_files

from omni_tts.models.qwen3_tts.checkpoint_config import SpeechTokenizerConfig
from omni_tts.models.qwen3_tts.speech_decoder import SpeechDecoder
from omni_tts.models.qwen3_tts import decoder_convs

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_tts"
CASES = FIXTURES / "cases"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())

GOLDEN_ATOL = 5e-6    # decoder alone vs the reference (fixtures README)
STREAM_ATOL = 1e-5    # streaming vs one-pass


def decoder_state_dict(variant: str) -> dict[str, torch.Tensor]:
    return read_tensors(safetensors_files(str(FIXTURES / variant / "speech_tokenizer")), "decoder.")


def load_decoder(variant: str = "tiny-custom-voice") -> SpeechDecoder:
    cfg = SpeechTokenizerConfig.load(str(FIXTURES / variant)).decoder
    return load_component(lambda: SpeechDecoder(cfg), FIXTURES / variant / "speech_tokenizer", "decoder.")


_MODELS: dict[str, SpeechDecoder] = {}


def tiny(variant: str = "tiny-custom-voice") -> SpeechDecoder:
    if variant not in _MODELS:
        _MODELS[variant] = load_decoder(variant)
    return _MODELS[variant]


def window72_decoder(layers: int = 3) -> SpeechDecoder:
    """Small widths but the released 72-frame window; head_dim * heads != hidden and 2 KV heads (GQA)."""
    base = SpeechTokenizerConfig.load(str(FIXTURES / "tiny-custom-voice")).decoder
    cfg = dataclasses.replace(base, codebook_dim=16, latent_dim=16, hidden_size=16, intermediate_size=32,
                              num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              sliding_window=72, upsample_rates=[4, 3], upsampling_ratios=[2], decoder_dim=16)
    st = dataclasses.replace(SpeechTokenizerConfig.load(str(FIXTURES / "tiny-custom-voice")), decoder=cfg)
    container = SpeechTokenizerWeights(st, with_encoder=False)
    randomize_speech_tokenizer(container, seed=1234)
    return container.decoder.eval()


def stream(model: SpeechDecoder, codes: torch.Tensor, schedule: list[int]) -> torch.Tensor:
    """Decode codes [B, Q, T] chunk by chunk; the schedule must cover T exactly."""
    assert sum(schedule) == codes.shape[-1]
    state = model.new_stream_state(codes.shape[0])
    out, start = [], 0
    for n in schedule:
        wav = model.decode_chunk(codes[..., start:start + n], state)
        assert wav.shape == (codes.shape[0], n * model.samples_per_frame)
        out.append(wav)
        start += n
    assert state.position.tolist() == [codes.shape[-1]] * codes.shape[0]
    return torch.cat(out, dim=-1)


def schedules(total: int) -> dict[str, list[int]]:
    def fixed(n: int) -> list[int]:
        return [n] * (total // n) + ([total % n] if total % n else [])

    mixed, rest, pattern = [], total, [3, 1, 17, 2, 71, 5, 1, 40, 9, 72, 73, 1, 30]
    for i in range(len(pattern) * 10):
        n = min(pattern[i % len(pattern)], rest)
        if n == 0:
            break
        mixed.append(n)
        rest -= n
    if rest:
        mixed.append(rest)
    return {"1": fixed(1), "2": fixed(2), "7": fixed(7), "25": fixed(25), "mixed": mixed}


def random_codes(model: SpeechDecoder, batch: int, frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.cfg.codebook_size, (batch, model.cfg.num_quantizers, frames), generator=g)


# ------------------------------------------------------------------------------------------------------------
# One-pass decode vs the reference
# ------------------------------------------------------------------------------------------------------------
def test_one_pass_420_frames_matches_reference():
    case = load_file(str(CASES / "decoder_420_frames.safetensors"))
    codes = case["codes"].T[None].contiguous()  # [1, 16, 420]
    wav = tiny()(codes)
    assert wav.shape == (1, 420 * 1920) and wav.dtype == torch.float32
    assert (wav[0] - case["wav_full"]).abs().max().item() <= GOLDEN_ATOL
    # the memory-bounded one-pass (internally streamed) is the same decode
    assert (tiny()(codes, chunk_frames=128) - wav).abs().max().item() < STREAM_ATOL


def test_gpu_formulation_on_the_cpu_matches_reference(monkeypatch):
    """The plain ops a GPU runs instead of the CPU-only formulations (decoder_convs.CPU_KERNELS), forced on the CPU:
    the golden audio, and the CPU formulation's audio, one pass and streamed."""
    case = load_file(str(CASES / "decoder_420_frames.safetensors"))
    codes = case["codes"].T[None].contiguous()[..., :120]
    model = tiny()
    cpu = model(codes, chunk_frames=7)
    monkeypatch.setattr(decoder_convs, "CPU_KERNELS", False)
    plain = model(codes)
    assert (plain[0] - case["wav_full"][:120 * 1920]).abs().max().item() <= GOLDEN_ATOL
    assert (model(codes, chunk_frames=7) - cpu).abs().max().item() < STREAM_ATOL
    assert (plain - cpu).abs().max().item() < STREAM_ATOL


def _case_rows():
    for entry in MANIFEST["cases"]:
        if entry["name"] == "decoder_420_frames":
            continue
        i = 0
        while f"codes_{i}" in entry["arrays"]:
            yield pytest.param(entry, i, id=f"{entry['name']}[{i}]")
            i += 1


@pytest.mark.parametrize("entry,row", list(_case_rows()))
def test_one_pass_cases_match_reference(entry, row):
    with safe_open(str(FIXTURES / entry["file"]), "pt") as f:
        codes = f.get_tensor(f"codes_{row}")
        golden = f.get_tensor(f"wav_{row}")
        ref = f.get_tensor(f"ref_codes_{row}") if f"ref_codes_{row}" in f.keys() else None
    model = tiny(entry["variant"])
    if ref is None:
        wav = model(codes.T[None].contiguous())[0]
    else:
        # ICL: the reference decodes ref_codes ++ codes and drops the reference's share of the samples
        total = torch.cat([ref, codes])
        full = model(total.T[None].contiguous())[0]
        cut = int(len(ref) / len(total) * full.shape[-1])
        wav = full[cut:]
    assert wav.shape == golden.shape
    assert (wav - golden).abs().max().item() <= GOLDEN_ATOL


# ------------------------------------------------------------------------------------------------------------
# Streaming == one-pass
# ------------------------------------------------------------------------------------------------------------
def test_streaming_matches_one_pass_tiny():
    model = tiny()
    codes = random_codes(model, 1, 400, seed=0)
    full = model(codes)
    for name, schedule in schedules(400).items():
        err = (stream(model, codes, schedule) - full).abs().max().item()
        assert err < STREAM_ATOL, f"schedule {name}: {err}"


def test_streaming_matches_one_pass_window_72():
    model = window72_decoder()
    frames = 260
    codes = random_codes(model, 2, frames, seed=1)
    full = model(codes)
    assert full.shape == (2, frames * 24)
    assert 0.05 < full.abs().mean().item() and (full.abs() >= 1.0).float().mean().item() < 0.01  # O(1), rarely clamped
    for name, schedule in schedules(frames).items():
        err = (stream(model, codes, schedule) - full).abs().max().item()
        assert err < STREAM_ATOL, f"schedule {name}: {err}"

    # The test is only meaningful if history beyond a short context matters: re-decoding the tail with 25 frames
    # of left context (the reference's chunked decode) must differ from the exact decode.
    tail = model(codes[..., 200 - 25:])[:, 25 * 24:]
    assert (tail - full[:, 200 * 24:]).abs().max().item() > 1e-4


def test_attention_window_is_72_frames_including_itself():
    # one attention layer: frame q sees frames q-71..q, so a change at frame 10 reaches frames 10..81 only
    model = window72_decoder(layers=1)
    x = torch.randn(1, 120, model.cfg.latent_dim, generator=torch.Generator().manual_seed(3))
    y = x.clone()
    y[:, 10] += 1.0
    with torch.no_grad():
        ox = model.pre_transformer(x, model.new_stream_state(1))
        oy = model.pre_transformer(y, model.new_stream_state(1))
    changed = (ox - oy).abs().amax(dim=-1)[0]  # [T]
    assert torch.all(changed[:10] == 0) and torch.all(changed[82:] == 0)
    assert torch.all(changed[10:82] > 0)


def test_zero_length_chunk_is_a_no_op():
    model = tiny()
    state = model.new_stream_state(2)
    assert model.decode_chunk(torch.zeros(2, 16, 0, dtype=torch.long), state).shape == (2, 0)
    assert state.position.tolist() == [0, 0]


# ------------------------------------------------------------------------------------------------------------
# Batching requests at different stream offsets
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["tiny", "window72"])
def test_batched_streaming_staggered_requests(which):
    model = tiny() if which == "tiny" else window72_decoder()
    spf, f = model.samples_per_frame, 6
    # request r joins at step starts[r] and runs steps[r] chunks of f frames; offsets differ at every step
    starts, steps = [0, 3, 17], [30, 20, 10]
    codes = [random_codes(model, 1, steps[r] * f, seed=10 + r) for r in range(3)]
    pool = model.new_stream_state(3)   # a slot per request, as code2wav's runner keeps them
    outputs: dict[int, list[torch.Tensor]] = {r: [] for r in range(3)}
    saw_distinct_offsets = False
    for step in range(max(s + n for s, n in zip(starts, steps))):
        active = [r for r in range(3) if starts[r] <= step < starts[r] + steps[r]]
        index = torch.tensor(active)
        batch = pool.gather(index)
        chunk = torch.cat([codes[r][..., (step - starts[r]) * f:(step - starts[r] + 1) * f] for r in active])
        offsets = batch.position.tolist()
        saw_distinct_offsets |= len(active) == 3 and len(set(offsets)) == 3 and max(offsets) > 72
        wav = model.decode_chunk(chunk, batch)
        assert wav.shape == (len(active), f * spf)
        pool.scatter(index, batch)
        for r, w in zip(active, wav):
            outputs[r].append(w)
    assert saw_distinct_offsets
    for r in range(3):
        full = model(codes[r])[0]
        err = (torch.cat(outputs[r]) - full).abs().max().item()
        assert err < STREAM_ATOL, f"request {r}: {err}"


def test_state_gather_scatter_and_row_views():
    model = tiny()
    pool = model.new_stream_state(3)
    model.decode_chunk(random_codes(model, 1, 3, seed=5), pool.rows(0, 1))     # a view: decodes in place
    model.decode_chunk(random_codes(model, 2, 11, seed=6), pool.rows(1, 3))
    assert pool.position.tolist() == [3, 11, 11]
    batch = pool.gather(torch.tensor([2, 0]))
    assert batch.batch_size == 2 and batch.position.tolist() == [11, 3]
    for x, y in zip(batch.conv + batch.keys, pool.conv + pool.keys):
        assert torch.equal(x[1], y[0])
    batch.keys[0].fill_(7.0)   # a copy: no aliasing with the pool until scattered back
    assert not torch.equal(pool.keys[0][2], batch.keys[0][0])
    pool.scatter(torch.tensor([2, 0]), batch)
    assert torch.equal(pool.keys[0][2], batch.keys[0][0]) and torch.equal(pool.keys[0][0], batch.keys[0][1])
    fixed = model.new_stream_state(2)
    pool.gather_into(torch.tensor([1, 2]), fixed)
    assert fixed.position.tolist() == [11, 11]


def test_a_streams_state_moves_as_one_arena_row():
    """Every float state tensor is a view of the arena, so a batch is gathered, scattered back and a slot zeroed
    in two kernels each (the arena's and the positions'), however many stateful layers the decoder has."""
    sys.path.insert(0, str(Path(__file__).parent.parent.parent / "benchmarks"))
    from bench_step_ops import OpCounter
    model = tiny()
    pool = model.new_stream_state(3)
    views = pool.conv + pool.overlap + pool.keys + pool.values
    assert len(views) > 8 and all(v.untyped_storage().data_ptr() == pool.arena.untyped_storage().data_ptr()
                                  for v in views)
    model.decode_chunk(random_codes(model, 3, 4, seed=8), pool)
    batch, index = model.new_stream_state(2), torch.tensor([2, 0])
    for move in (lambda: pool.gather_into(index, batch), lambda: pool.scatter(index, batch),
                 lambda: pool.zero_rows(1, 2)):
        with OpCounter() as counter:
            move()
        assert counter.totals()[1] == 2
    assert pool.position.tolist() == [4, 0, 4] and not pool.arena[1].any() and pool.arena[0].any()
    assert torch.equal(batch.keys[1][0], pool.keys[1][2]) and torch.equal(batch.conv[0][1], pool.conv[0][0])


# ------------------------------------------------------------------------------------------------------------
# Loading and sizes
# ------------------------------------------------------------------------------------------------------------
def test_strict_load_rejects_missing_and_extra_keys():
    cfg = SpeechTokenizerConfig.load(str(FIXTURES / "tiny-custom-voice")).decoder
    sd = decoder_state_dict("tiny-custom-voice")
    assert set(SpeechDecoder(cfg).state_dict()) == set(sd)
    missing = dict(sd)
    missing.pop("quantizer.rvq_rest.input_proj.weight")
    with pytest.raises(WeightsError, match="missing tensors: quantizer.rvq_rest.input_proj.weight"):
        load_strict(SpeechDecoder(cfg), missing, "ckpt", "cpu", torch.float32)
    extra = dict(sd, **{"pre_transformer.rotary_emb.inv_freq": torch.zeros(4)})
    with pytest.raises(WeightsError, match="unexpected tensors: pre_transformer.rotary_emb.inv_freq"):
        load_strict(SpeechDecoder(cfg), extra, "ckpt", "cpu", torch.float32)


def test_released_size_on_meta():
    base = SpeechTokenizerConfig.load(str(FIXTURES / "tiny-custom-voice")).decoder
    cfg = dataclasses.replace(base, codebook_dim=512, latent_dim=1024, hidden_size=512, intermediate_size=1024,
                              num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=16, head_dim=64,
                              sliding_window=72, decoder_dim=1536)
    with torch.device("meta"):
        model = SpeechDecoder(cfg)
    total = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    pre = sum(p.numel() for p in model.pre_transformer.parameters())
    assert abs(total / 1e6 - 114.3) < 0.05, total
    assert abs(pre / 1e6 - 30.4) < 0.05, pre
    attn = model.pre_transformer.layers[0].self_attn
    assert attn.q_proj.weight.shape == (1024, 512) and attn.o_proj.weight.shape == (512, 1024)
    assert model.samples_per_frame == 1920
