"""The reference's logits processing, batched with per-row parameters (model doc §8).

Talker order: repetition penalty (generated c0 ids only) → min-new-tokens → suppressed ids → temperature → top-k
→ top-p → sample (argmax when greedy). The code predictor uses only temperature / top-k / top-p.
Noise is a function of (request seed, token index, vocab id), so a batch's composition never changes a seeded
request's output. A row with a small top-k (the checkpoints' default is 50) samples among its `CANDIDATES` best ids
(one `topk`) instead of sorting the whole vocabulary twice, which cost more than the model at batch 16 on a CPU; which
path a row takes depends on its own top-k only, so batching still never changes its draw.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch

# what a request asks and its resolution live in the torch-free sampling_params; imported here by this module's users
from .sampling_params import MIN_NEW_TOKENS, ResolvedSampling, SamplingParams, resolve_sampling  # noqa: F401

CANDIDATES = 64              # a top-k up to this samples among the row's `topk` candidates, not a sorted vocabulary


STREAMS = 16                 # draws per token index: stream 0 is the talker's c0, stream j codebook j

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


def hash_ids(ids: torch.Tensor) -> torch.Tensor:
    """The vocab ids' input to their noise (a draw's key is the other input)."""
    return _mul32(ids, 0x9E3779B9)


def noise_keys(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """[B, STREAMS] the key of each row's draw at its counter, per stream: a pure function of (seed, counter,
    stream). A step's 16 draws (codebooks 1..15, then the next c0) share the counter, so one pass makes them all.
    seeds: [B] int64 in [0, 2**63); counters: [B] int64 (the row's token index)."""
    streams = torch.arange(STREAMS, device=seeds.device)
    key = _mix32((counters[:, None] * STREAMS + streams) & _MASK32)
    key = _mix32(((seeds >> 32) & _MASK32)[:, None] ^ key)
    return _mix32((seeds & _MASK32)[:, None] ^ key)


def exponential_noise(seeds: torch.Tensor, counters: torch.Tensor, stream: int, vocab: int) -> torch.Tensor:
    """Exp(1) noise [B, vocab], a pure function of (row's seed, row's counter, stream, vocab id).

    Counter-based, so one call draws for every row of a batch (no per-row generator loop, nothing a CUDA graph
    cannot capture), and a request's draws never depend on the batch it runs in. seeds: [B] int64 in [0, 2**63);
    counters: [B] int64 (the row's token index); stream: 0 for the talker, j for codebook j."""
    ids = torch.arange(vocab, device=seeds.device)[None]
    return _noise(noise_keys(seeds, counters)[:, stream], hash_ids(ids))


def _noise(keys: torch.Tensor, hashes: torch.Tensor) -> torch.Tensor:
    """The noise of each row's ids, from keys [B] (a `noise_keys` column) and the ids' `hash_ids` ([1, V] or
    [B, C]): the same value for an id on either path."""
    bits = _mix32(keys[:, None] ^ hashes)
    # 24 bits, in (0, 1): float32 rounds the top value (2**24 - 0.5) / 2**24 up to 1.0, whose noise of 0 would make
    # a masked id's 0 / 0 a NaN that wins the argmax (a suppressed c0 once every ~16k frames), so clamp below 1
    uniform = (((bits >> 8).float() + 0.5) * 2.0 ** -24).clamp(max=1.0 - 2.0 ** -24)
    return -torch.log(uniform)


@dataclass(frozen=True)
class VocabTables:
    """A vocabulary's sampling constants, made once: a captured step replays no kernel that remakes them."""
    hashes: torch.Tensor   # [V] hash_ids of every vocab id: the noise input of an id on either path
    ranks: torch.Tensor    # [1, min(CANDIDATES, V)] 0, 1, ...: a candidate's rank, best first

    @staticmethod
    def of(vocab: int, device: torch.device | str) -> "VocabTables":
        ids = torch.arange(vocab, device=device)
        return VocabTables(hash_ids(ids), ids[None, :CANDIDATES].clone())


class Warpers:
    """B rows' temperature / top-k / top-p ([B] each) over one vocabulary, and what every draw derives from them
    alone: made at the first draw that needs them and shared by the rest (the code predictor draws 15 times per
    step with the same rows)."""

    def __init__(self, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 tables: VocabTables) -> None:
        self.temperature, self.top_k, self.top_p, self.tables = temperature, top_k, top_p, tables

    @cached_property
    def sampled(self) -> torch.Tensor:
        """[B] the row samples (temperature > 0); the others take the argmax."""
        return self.temperature > 0

    @cached_property
    def divisor(self) -> torch.Tensor:
        """[B, 1] a sampled row's temperature, 1 for a greedy row."""
        return torch.where(self.sampled, self.temperature, torch.ones_like(self.temperature))[:, None]

    @cached_property
    def by_candidates(self) -> torch.Tensor:
        """[B] the row samples among its candidates (0 < top_k <= CANDIDATES)."""
        return self.sampled & (self.top_k > 0) & (self.top_k <= CANDIDATES)

    @cached_property
    def by_sorted(self) -> torch.Tensor:
        """[B] the row samples over the sorted vocabulary (top-k off or larger)."""
        return self.sampled & ~self.by_candidates

    @cached_property
    def kth(self) -> torch.Tensor:
        """[B, 1] the index of the row's k-th best score in the sorted vocabulary (top-k 0 or >= V: the last)."""
        vocab = self.tables.hashes.shape[0]
        k = torch.where((self.top_k > 0) & (self.top_k < vocab), self.top_k, torch.full_like(self.top_k, vocab))
        return (k - 1)[:, None]

    @cached_property
    def tail_mass(self) -> torch.Tensor:
        """[B, 1] 1 - top_p: the low tail top-p drops has at most this mass."""
        return (1 - self.top_p)[:, None]

    @cached_property
    def beyond_k(self) -> torch.Tensor:
        """[B, min(CANDIDATES, V)] the candidate's rank is past the row's top-k."""
        return self.tables.ranks >= self.top_k[:, None]

    @cached_property
    def cuts_tail(self) -> torch.Tensor:
        """[B, 1] top-p is on (< 1)."""
        return (self.top_p < 1)[:, None]


@dataclass(frozen=True)
class SamplingPaths:
    """Which sampling paths a batch runs, known on the host from its rows' parameters (no device sync)."""
    candidates: bool   # some sampled row has 0 < top_k <= CANDIDATES
    full: bool         # some sampled row has top-k off or larger

    @staticmethod
    def of(temperatures: Sequence[float], top_ks: Sequence[int]) -> "SamplingPaths":
        short = [0 < k <= CANDIDATES for t, k in zip(temperatures, top_ks) if t > 0]
        return SamplingPaths(any(short), not all(short))


GREEDY = SamplingPaths(False, False)
CANDIDATES_ONLY = SamplingPaths(True, False)   # the common static step: every sampled row keeps a small top-k
ALL_PATHS = SamplingPaths(True, True)
STATIC_PATHS = (ALL_PATHS, CANDIDATES_ONLY)    # the path sets of a static-shape step (one graph each)


def warp_and_sample(logits: torch.Tensor, warpers: Warpers, keys: torch.Tensor, paths: SamplingPaths
                    ) -> torch.Tensor:
    """logits: [B, V] already penalised/suppressed; warpers: the rows' parameters over this vocabulary; keys: [B]
    the rows' noise keys for this draw (a `noise_keys` column). Returns ids [B].

    Rows with temperature 0 take the argmax; `paths` skips the work no row needs (GREEDY: all rows greedy). Sampling
    uses the exponential race (argmax p/q with q ~ Exp(1)), which is exactly categorical sampling and needs no host
    sync."""
    ids = logits.argmax(dim=-1)
    if paths == GREEDY:
        return ids
    scores = logits.float() / warpers.divisor
    if paths.full:
        ids = torch.where(warpers.by_sorted, _sample_sorted(scores, warpers, keys), ids)
    if paths.candidates:
        ids = torch.where(warpers.by_candidates, _sample_candidates(scores, warpers, keys), ids)
    return ids


def _sample_sorted(scores: torch.Tensor, warpers: Warpers, keys: torch.Tensor) -> torch.Tensor:
    """Any top-k (0 or >= V: off): HF's warpers over the whole sorted vocabulary."""
    # top-k: keep scores >= the k-th largest
    sorted_desc = scores.sort(dim=-1, descending=True).values
    scores = scores.masked_fill(scores < sorted_desc.gather(1, warpers.kth), float("-inf"))
    # top-p (HF order: ascending sort, drop the low tail whose cumulative mass <= 1 - p, always keep the best)
    sorted_asc, order = scores.sort(dim=-1)
    cumulative = sorted_asc.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= warpers.tail_mass
    remove_sorted[:, -1] = False
    # order is a permutation: the scatter writes every cell, so the target needs no zeros first
    remove = torch.empty_like(remove_sorted).scatter_(1, order, remove_sorted)
    probs = scores.masked_fill(remove, float("-inf")).softmax(dim=-1)
    return (probs / _noise(keys, warpers.tables.hashes[None])).argmax(dim=-1)


def _sample_candidates(scores: torch.Tensor, warpers: Warpers, keys: torch.Tensor) -> torch.Tensor:
    """0 < top_k <= CANDIDATES: the same warpers over the row's best ids only (exact ties at the k-th score keep
    the lower id, where the sorted path keeps them all). The ascending tail with mass <= 1 - p is, best first,
    every candidate whose better candidates already hold mass >= p."""
    values, ids = scores.topk(warpers.beyond_k.shape[-1], dim=-1)                      # best first
    probs = values.masked_fill(warpers.beyond_k, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill((before >= warpers.top_p[:, None]) & warpers.cuts_tail, 0.0)
    pick = (probs / _noise(keys, warpers.tables.hashes[ids])).argmax(dim=-1)
    return ids.gather(1, pick[:, None])[:, 0]


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
        self.host_params: list[ResolvedSampling | None] = [None] * capacity   # picks the sampling paths, no sync
        self.eos_id = eos_id
        self.seen = torch.zeros(capacity, talker_vocab, dtype=torch.bool, device=device)
        self.num_generated = torch.zeros(capacity, dtype=torch.long, device=device)
        suppressed = torch.zeros(talker_vocab, dtype=torch.bool, device=device)
        suppressed[audio_vocab:] = True
        suppressed[eos_id] = False
        self.suppressed = suppressed
        self.eos_column = torch.arange(talker_vocab, device=device) == eos_id
        self.talker_tables = VocabTables.of(talker_vocab, device)
        self.codebook_tables = VocabTables.of(audio_vocab, device)

    def set_row(self, row: int, params: ResolvedSampling) -> None:
        for name, column in self.columns.items():
            column[row] = getattr(params, name)
        self.seeds[row] = params.seed
        self.host_params[row] = params
        self.seen[row] = False
        self.num_generated[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        for column in list(self.columns.values()) + [self.seen, self.num_generated, self.seeds]:
            column[dst] = column[src]
        self.host_params[dst] = self.host_params[src]

    def noise_keys(self, rows: slice) -> torch.Tensor:
        """[B, STREAMS] the keys of `rows`' draws at their current token index: the next c0's (stream 0) and, since
        the code predictor's token index is the row's c0 count (this frame's c0 included), its codebooks'."""
        return noise_keys(self.seeds[rows], self.num_generated[rows])

    def static_paths(self, rows: slice) -> SamplingPaths:
        """The path set (of STATIC_PATHS) a static-shape step over `rows` runs: CANDIDATES_ONLY unless a row's
        talker or code-predictor draw needs the sorted vocabulary. From the host-side parameters, no sync."""
        full = self._paths(rows, subtalker=False).full or self._paths(rows, subtalker=True).full
        return ALL_PATHS if full else CANDIDATES_ONLY

    def _paths(self, rows: slice, subtalker: bool) -> SamplingPaths:
        params = [p for p in self.host_params[rows] if p is not None]   # a free row's draw is thrown away
        if subtalker:
            return SamplingPaths.of([p.subtalker_temperature for p in params], [p.subtalker_top_k for p in params])
        return SamplingPaths.of([p.temperature for p in params], [p.top_k for p in params])

    def sample_talker(self, logits: torch.Tensor, rows: slice, paths: SamplingPaths | None = None,
                      keys: torch.Tensor | None = None) -> torch.Tensor:
        """logits: [B, talker_vocab] for `rows` (B rows) → c0 ids [B] (audio code or EOS), recorded as generated.
        paths: what a static-shape step runs whatever the rows ask (greedy rows still take the argmax); None: only
        what the rows need. keys: the step's `noise_keys(rows)` when the caller made them already."""
        c = self.columns
        logits = logits.float()
        penalty = c["repetition_penalty"][rows, None]
        penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(self.seen[rows], penalised, logits)
        num_generated = self.num_generated[rows]
        too_early = (num_generated < MIN_NEW_TOKENS)[:, None] & self.eos_column
        logits = logits.masked_fill(too_early | self.suppressed, float("-inf"))
        warpers = Warpers(c["temperature"][rows], c["top_k"][rows], c["top_p"][rows], self.talker_tables)
        keys = self.noise_keys(rows) if keys is None else keys
        paths = self._paths(rows, subtalker=False) if paths is None else paths
        ids = warp_and_sample(logits, warpers, keys[:, 0], paths)
        self.seen[rows].scatter_(1, ids[:, None], True)
        self.num_generated[rows] += 1
        return ids

    def codebook_sampler(self, rows: slice, paths: SamplingPaths | None = None, keys: torch.Tensor | None = None
                         ) -> Callable[[torch.Tensor, int], torch.Tensor]:
        """The code predictor's draw for codebook j+1 over `rows`: (logits [B, 2048], j) → ids [B], at stream j+1
        of the rows' keys (so no draw shares (counter, stream) with another). paths and keys as in sample_talker."""
        c = self.columns
        warpers = Warpers(c["subtalker_temperature"][rows], c["subtalker_top_k"][rows], c["subtalker_top_p"][rows],
                          self.codebook_tables)
        keys = self.noise_keys(rows) if keys is None else keys
        paths = self._paths(rows, subtalker=True) if paths is None else paths

        def sample(logits: torch.Tensor, j: int) -> torch.Tensor:
            return warp_and_sample(logits, warpers, keys[:, j + 1], paths)
        return sample
