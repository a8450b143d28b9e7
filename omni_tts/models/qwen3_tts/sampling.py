"""Sampling parameters and the reference's logits processing, batched with per-row parameters (model doc §8).

Talker order: repetition penalty (generated c0 ids only) → min-new-tokens → suppressed ids → temperature → top-k
→ top-p → sample (argmax when greedy). The code predictor uses only temperature / top-k / top-p.
Noise is a function of (request seed, token index, vocab id), so a batch's composition never changes a seeded
request's output.
"""
from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Any, Callable

import torch

# wrapper fallbacks (reference `Qwen3TTSModel`), used when generation_config.json lacks a key
FALLBACK_GENERATION = dict(do_sample=True, temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05,
                           subtalker_dosample=True, subtalker_temperature=0.9, subtalker_top_k=50,
                           subtalker_top_p=1.0, max_new_tokens=2048)
MIN_NEW_TOKENS = 2
# request ranges, shared with the HTTP schema (entrypoints/protocol.py)
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_TOP_K = 2 ** 31 - 1      # beyond the vocab means "no top-k"; bounded so it fits every integer type on its way
MAX_SEED = 2 ** 63 - 1       # the noise hash takes an int64 seed
# name: (low, high, low excluded)
_RANGES = {"temperature": (0.0, MAX_TEMPERATURE, False), "subtalker_temperature": (0.0, MAX_TEMPERATURE, False),
           "top_p": (0.0, 1.0, True), "subtalker_top_p": (0.0, 1.0, True),
           "repetition_penalty": (0.0, MAX_REPETITION_PENALTY, True),
           "top_k": (0, MAX_TOP_K, False), "subtalker_top_k": (0, MAX_TOP_K, False),
           "max_new_tokens": (1, math.inf, False), "seed": (0, MAX_SEED, False)}


@dataclass
class SamplingParams:
    """What a request asks for; None means "use the checkpoint's generation_config.json, then the fallback".

    temperature 0 means greedy for the talker and, unless subtalker_temperature is set, for the code predictor.
    """
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    subtalker_temperature: float | None = None
    subtalker_top_k: int | None = None
    subtalker_top_p: float | None = None
    max_new_tokens: int | None = None
    seed: int | None = None

    def validate(self) -> None:
        """ValueError naming the field for out-of-range values (NaN included)."""
        for name, (low, high, low_excluded) in _RANGES.items():
            value = getattr(self, name)
            if value is None or (((low < value) if low_excluded else (low <= value)) and value <= high):
                continue
            bound = (f"{'>' if low_excluded else '>='} {_number(low)}" if high == math.inf else
                     f"in {'(' if low_excluded else '['}{_number(low)}, {_number(high)}]")
            raise ValueError(f"{name} must be {bound}, got {value}")


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


@dataclass(frozen=True)
class ResolvedSampling:
    """Concrete per-request values; temperature 0 = greedy."""
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    subtalker_temperature: float
    subtalker_top_k: int
    subtalker_top_p: float
    max_new_tokens: int
    seed: int


def resolve_sampling(params: SamplingParams, generation_config: dict[str, Any]) -> ResolvedSampling:
    params.validate()
    defaults = {k: generation_config.get(k, v) for k, v in FALLBACK_GENERATION.items()}

    def pick(name: str) -> Any:
        value = getattr(params, name)
        return defaults[name] if value is None else value

    temperature = pick("temperature") if defaults["do_sample"] or params.temperature is not None else 0.0
    if params.subtalker_temperature is not None:
        sub_temperature = params.subtalker_temperature
    elif params.temperature == 0 or not defaults["subtalker_dosample"]:
        sub_temperature = 0.0
    else:
        sub_temperature = defaults["subtalker_temperature"]
    return ResolvedSampling(temperature=float(temperature), top_k=int(pick("top_k")), top_p=float(pick("top_p")),
                            repetition_penalty=float(pick("repetition_penalty")),
                            subtalker_temperature=float(sub_temperature), subtalker_top_k=int(pick("subtalker_top_k")),
                            subtalker_top_p=float(pick("subtalker_top_p")), max_new_tokens=int(pick("max_new_tokens")),
                            seed=secrets.randbits(63) if params.seed is None else int(params.seed))


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32, in int64 without overflow (two 16-bit halves of c)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser: a bijection that spreads every input bit over the output."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def exponential_noise(seeds: torch.Tensor, counters: torch.Tensor, stream: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise [B, vocab], a pure function of (row's seed, row's counter, stream, vocab id).

    Counter-based, so one call draws for every row of a batch (no per-row generator loop, nothing a CUDA graph
    cannot capture), and a request's draws never depend on the batch it runs in. seeds: [B] int64 in [0, 2**63);
    counters: [B] int64 (the row's token index); stream: 0 for the talker, j for codebook j."""
    key = _mix32(((counters * 16 + stream) & _MASK32))
    key = _mix32(((seeds >> 32) & _MASK32) ^ key)
    key = _mix32((seeds & _MASK32) ^ key)
    ids = _mul32(torch.arange(vocab, device=seeds.device), 0x9E3779B9)
    bits = _mix32(key[:, None] ^ ids[None])
    # 24 bits, in (0, 1): float32 rounds the top value (2**24 - 0.5) / 2**24 up to 1.0, whose noise of 0 would make
    # a masked id's 0 / 0 a NaN that wins the argmax (a suppressed c0 once every ~16k frames), so clamp below 1
    uniform = (((bits >> 8).float() + 0.5) * 2.0 ** -24).clamp(max=1.0 - 2.0 ** -24)
    return -torch.log(uniform)


def warp_and_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    seeds: torch.Tensor, counters: torch.Tensor, stream: int, any_sampled: bool) -> torch.Tensor:
    """logits: [B, V] already penalised/suppressed; per-row temperature/top_k/top_p/seeds/counters: [B].
    Returns ids [B].

    Rows with temperature 0 take the argmax. `any_sampled` (known on the host from the parameters) skips the
    sampling work for all-greedy batches; a captured graph passes True (the result is the same). Sampling uses
    the exponential race (argmax p/q with q ~ Exp(1)), which is exactly categorical sampling and needs no host
    sync."""
    greedy_ids = logits.argmax(dim=-1)
    if not any_sampled:
        return greedy_ids
    sampled = temperature > 0
    vocab = logits.shape[-1]
    scores = logits.float() / torch.where(sampled, temperature, torch.ones_like(temperature))[:, None]
    # top-k: keep scores >= the k-th largest (k = 0 or >= V disables)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, torch.full_like(top_k, vocab))
    sorted_desc = scores.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (k - 1)[:, None])
    scores = scores.masked_fill(scores < kth, float("-inf"))
    # top-p (HF order: ascending sort, drop the low tail whose cumulative mass <= 1 - p, always keep the best)
    sorted_asc, order = scores.sort(dim=-1)
    cumulative = sorted_asc.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)[:, None]
    remove_sorted[:, -1] = False
    remove = torch.zeros_like(remove_sorted).scatter(1, order, remove_sorted)
    scores = scores.masked_fill(remove, float("-inf"))
    probs = scores.softmax(dim=-1)
    sampled_ids = (probs / exponential_noise(seeds, counters, stream, vocab)).argmax(dim=-1)
    return torch.where(sampled, sampled_ids, greedy_ids)


class BatchSampler:
    """Per-row sampling state for up to `capacity` requests, rows 0..B-1 active: parameters and seeds as device
    tensors and the codebook-0 ids each row has generated (for the repetition penalty).

    Rows are slots: `set_row` when a request joins, `move_row` when the engine compacts after one leaves."""

    _COLUMNS = {"temperature": torch.float32, "top_k": torch.long, "top_p": torch.float32,
                "repetition_penalty": torch.float32, "subtalker_temperature": torch.float32,
                "subtalker_top_k": torch.long, "subtalker_top_p": torch.float32}

    def __init__(self, capacity: int, talker_vocab: int, audio_vocab: int, eos_id: int,
                 device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.columns = {name: torch.zeros(capacity, dtype=dtype, device=device) for name, dtype in self._COLUMNS.items()}
        self.seeds = torch.zeros(capacity, dtype=torch.long, device=device)
        self.host_temperature = [0.0] * capacity
        self.host_sub_temperature = [0.0] * capacity
        self.eos_id = eos_id
        self.seen = torch.zeros(capacity, talker_vocab, dtype=torch.bool, device=device)
        self.num_generated = torch.zeros(capacity, dtype=torch.long, device=device)
        suppressed = torch.zeros(talker_vocab, dtype=torch.bool, device=device)
        suppressed[audio_vocab:] = True
        suppressed[eos_id] = False
        self.suppressed = suppressed
        self.eos_column = torch.arange(talker_vocab, device=device) == eos_id

    @classmethod
    def for_batch(cls, params: list[ResolvedSampling], talker_vocab: int, audio_vocab: int, eos_id: int,
                  device: torch.device | str) -> "BatchSampler":
        sampler = cls(len(params), talker_vocab, audio_vocab, eos_id, device)
        for row, p in enumerate(params):
            sampler.set_row(row, p)
        return sampler

    def set_row(self, row: int, params: ResolvedSampling) -> None:
        for name, column in self.columns.items():
            column[row] = getattr(params, name)
        self.seeds[row] = params.seed
        self.host_temperature[row] = params.temperature
        self.host_sub_temperature[row] = params.subtalker_temperature
        self.seen[row] = False
        self.num_generated[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        for column in list(self.columns.values()) + [self.seen, self.num_generated, self.seeds]:
            column[dst] = column[src]
        self.host_temperature[dst] = self.host_temperature[src]
        self.host_sub_temperature[dst] = self.host_sub_temperature[src]

    def sample_talker(self, logits: torch.Tensor, rows: slice, always_sample: bool = False) -> torch.Tensor:
        """logits: [B, talker_vocab] for `rows` (B rows) → c0 ids [B] (audio code or EOS), recorded as generated.
        always_sample: run the sampling path even for an all-greedy batch (a captured graph must not branch on
        the batch's parameters; greedy rows still take the argmax)."""
        c = {name: column[rows] for name, column in self.columns.items()}
        logits = logits.float()
        penalty = c["repetition_penalty"][:, None]
        penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(self.seen[rows], penalised, logits)
        num_generated = self.num_generated[rows]
        too_early = (num_generated < MIN_NEW_TOKENS)[:, None] & self.eos_column
        logits = logits.masked_fill(too_early | self.suppressed, float("-inf"))
        ids = warp_and_sample(logits, c["temperature"], c["top_k"], c["top_p"], self.seeds[rows], num_generated, 0,
                              always_sample or any(t > 0 for t in self.host_temperature[rows]))
        self.seen[rows].scatter_(1, ids[:, None], True)
        self.num_generated[rows] += 1
        return ids

    def codebook_sampler(self, rows: slice, always_sample: bool = False) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """The code predictor's draw for codebook j+1 over `rows`: (logits [B, 2048], j) → ids [B]. Its token
        index is the row's c0 count (c0 of this frame included), so no draw shares (counter, stream) with another."""
        c = {name: column[rows] for name, column in self.columns.items()}
        seeds, counters = self.seeds[rows], self.num_generated[rows]
        any_sampled = always_sample or any(t > 0 for t in self.host_sub_temperature[rows])

        def sample(logits: torch.Tensor, j: int) -> torch.Tensor:
            return warp_and_sample(logits.float(), c["subtalker_temperature"], c["subtalker_top_k"],
                                   c["subtalker_top_p"], seeds, counters, j + 1, any_sampled)
        return sample
