"""The reference's logits processing, batched with per-row parameters (model doc §8).

Talker order: repetition penalty (generated c0 ids only) → min-new-tokens → suppressed ids → temperature → top-k
→ top-p → sample (argmax when greedy). The code predictor uses only temperature / top-k / top-p.
Noise is a function of (request seed, token index, vocab id), so a batch's composition never changes a seeded
request's output. A row with a small top-k (the checkpoints' default is 50) samples among its `CANDIDATES` best ids
(one `topk`) instead of sorting the whole vocabulary twice (the sorts cost more than the model on a CPU); which path
a row takes depends on its own top-k only, so batching still never changes its draw. What a draw reads of a row's
parameters is derived once, when the request joins (`RowWarpers.set_row`): a step only slices rows.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, fields
from types import ModuleType

import torch

# what a request asks and its resolution live in the torch-free sampling_params; imported here by this module's users
from .sampling_params import MIN_NEW_TOKENS, ResolvedSampling, SamplingParams, resolve_sampling  # noqa: F401

CANDIDATES = 64              # a top-k up to this samples among the row's `topk` candidates, not a sorted vocabulary
STREAMS = 16                 # draws per token index: stream 0 is the talker's c0, stream j codebook j

_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x, c < 2**32: the int64 product wraps mod 2**64 (two's complement, on the CPU and
    on CUDA), which keeps its low 32 bits, so one product and a mask: 2 kernels where the overflow-free form (two
    16-bit halves of c) took 6, the same bits (tests/models/test_sampling.py)."""
    return (x * c) & _MASK32


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
class SamplingPaths:
    """Which sampling paths a draw runs, known on the host (no device sync): `|` of its rows' own paths."""
    candidates: bool   # some sampled row has 0 < top_k <= CANDIDATES
    full: bool         # some sampled row has top-k off or larger

    def __or__(self, other: SamplingPaths) -> SamplingPaths:
        return SamplingPaths(self.candidates or other.candidates, self.full or other.full)


GREEDY = SamplingPaths(False, False)
CANDIDATES_ONLY = SamplingPaths(True, False)   # the common static step: every sampled row keeps a small top-k
SORTED_ONLY = SamplingPaths(False, True)
ALL_PATHS = SamplingPaths(True, True)
STATIC_PATHS = (ALL_PATHS, CANDIDATES_ONLY)    # the path sets of a static-shape step (one graph each)


@dataclass(frozen=True)
class Warpers:
    """Rows' temperature / top-k / top-p over one vocabulary, in the forms the draws read (`RowWarpers.rows`)."""
    divisor: torch.Tensor        # [B, 1] the temperature; 1 for a greedy row (temperature 0), which takes the argmax
    by_candidates: torch.Tensor  # [B] the row samples among its candidates (0 < top_k <= CANDIDATES)
    by_sorted: torch.Tensor      # [B] the row samples over the sorted vocabulary (top-k off or larger)
    kth: torch.Tensor            # [B, 1] index of its k-th best score in the sorted vocabulary (top-k off: the last)
    tail_mass: torch.Tensor      # [B, 1] 1 - top_p: the low tail top-p drops has at most this mass
    beyond_k: torch.Tensor       # [B, min(CANDIDATES, V)] the candidate's rank is past the row's top-k
    top_p: torch.Tensor          # [B, 1] top_p; inf where it is 1 (off: no rounding of the cumsum cuts a candidate)
    hashes: torch.Tensor         # [V] hash_ids of every vocab id: an id's noise input on either path (not per row)


_ROW_FIELDS = [f.name for f in fields(Warpers) if f.name != "hashes"]


class RowWarpers:
    """The `Warpers` of `capacity` rows over a vocabulary of `vocab` ids, set when a request joins (`set_row`), moved
    when the engine compacts (`move_row`), sliced by a step (`rows`: views, no kernel, so a captured step replays
    none of this), and each row's sampling paths on the host."""

    def __init__(self, capacity: int, vocab: int, device: torch.device | str) -> None:
        self.vocab, self.num_candidates = vocab, min(CANDIDATES, vocab)
        ids = torch.arange(vocab, device=device)
        self.ranks = ids[:self.num_candidates]   # a candidate's rank, best first

        def column(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.zeros(capacity, *shape, dtype=dtype, device=device)
        self.table = Warpers(divisor=column(1), by_candidates=column(dtype=torch.bool),
                             by_sorted=column(dtype=torch.bool), kth=column(1, dtype=torch.long),
                             tail_mass=column(1), beyond_k=column(self.num_candidates, dtype=torch.bool),
                             top_p=column(1), hashes=hash_ids(ids))
        self.paths = [GREEDY] * capacity
        for row in range(capacity):   # a free row a static step pads with draws greedily (and is thrown away)
            self.set_row(row, 0.0, 0, 1.0)

    def set_row(self, row: int, temperature: float, top_k: int, top_p: float) -> None:
        # derived in float32, as the draws compare them, and written as Python numbers that float32 holds exactly
        # (a fill, no host→device copy)
        temperature32, top_p32 = (torch.tensor(x, dtype=torch.float32) for x in (temperature, top_p))
        sampled = bool(temperature32 > 0)
        by_candidates = sampled and 0 < top_k <= CANDIDATES
        values = dict(divisor=float(temperature32) if sampled else 1.0, by_candidates=by_candidates,
                      by_sorted=sampled and not by_candidates,
                      kth=(top_k if 0 < top_k < self.vocab else self.vocab) - 1, tail_mass=float(1 - top_p32),
                      top_p=float(top_p32) if top_p32 < 1 else float("inf"))
        for name, value in values.items():
            getattr(self.table, name)[row] = value
        self.table.beyond_k[row] = self.ranks >= top_k
        self.paths[row] = CANDIDATES_ONLY if by_candidates else SORTED_ONLY if sampled else GREEDY

    def move_row(self, src: int, dst: int) -> None:
        for name in _ROW_FIELDS:
            column = getattr(self.table, name)
            column[dst] = column[src]
        self.paths[dst] = self.paths[src]

    def rows(self, rows: slice) -> Warpers:
        return Warpers(**{name: getattr(self.table, name)[rows] for name in _ROW_FIELDS}, hashes=self.table.hashes)

    def paths_of(self, rows: slice) -> SamplingPaths:
        """The paths a draw over `rows` needs (a greedy row: none; a row runs only its own path)."""
        return functools.reduce(operator.or_, self.paths[rows], GREEDY)


def warp_and_sample(logits: torch.Tensor, warpers: Warpers, keys: torch.Tensor, paths: SamplingPaths,
                    kernels: ModuleType | None = None) -> torch.Tensor:
    """logits: [B, V] already penalised/suppressed; warpers: the rows' parameters over this vocabulary; keys: [B]
    the rows' noise keys for this draw (a `noise_keys` column). Returns ids [B].

    Rows with temperature 0 take the argmax; `paths` skips the work no row needs (GREEDY: all rows greedy), and
    running a path a row does not take leaves its draw unchanged. Sampling is the exponential race (argmax p/q with
    q ~ Exp(1)), which is exactly categorical sampling and needs no host sync. kernels: fused_kernels, whose
    `sample_candidates` draws a candidates-path row in one kernel (None: the plain ops)."""
    ids = logits.argmax(dim=-1)
    if paths == GREEDY:
        return ids
    scores = logits.float() / warpers.divisor
    if paths.full:
        ids = torch.where(warpers.by_sorted, _sample_sorted(scores, warpers, keys), ids)
    if paths.candidates:
        ids = torch.where(warpers.by_candidates, _sample_candidates(scores, warpers, keys, kernels), ids)
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
    return (probs / _noise(keys, warpers.hashes[None])).argmax(dim=-1)


def _sample_candidates(scores: torch.Tensor, warpers: Warpers, keys: torch.Tensor,
                       kernels: ModuleType | None = None) -> torch.Tensor:
    """0 < top_k <= CANDIDATES: the same warpers over the row's best ids only (exact ties at the k-th score keep
    the lower id, where the sorted path keeps them all). The ascending tail with mass <= 1 - p is, best first,
    every candidate whose better candidates already hold mass >= p. kernels: fused_kernels (everything after
    the topk in one kernel), or None."""
    values, ids = scores.topk(warpers.beyond_k.shape[-1], dim=-1)                      # best first
    if kernels is not None:
        return kernels.sample_candidates(values, ids, warpers.beyond_k, warpers.top_p, keys, warpers.hashes)
    probs = values.masked_fill(warpers.beyond_k, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(before >= warpers.top_p, 0.0)
    pick = (probs / _noise(keys, warpers.hashes[ids])).argmax(dim=-1)
    return ids.gather(1, pick[:, None])[:, 0]


class BatchSampler:
    """Per-row sampling state for up to `capacity` requests, rows 0..B-1 active: the talker's and the code
    predictor's warpers, the repetition penalty, seeds, and the codebook-0 ids each row has generated (for the
    penalty and min-new-tokens). The runner calls it: `sample_talker` for c0, `warp_and_sample` over
    `codebooks.rows(...)` for codebooks 1..15.

    Rows are slots: `set_row` when a request joins, `move_row` when the engine compacts after one leaves."""

    def __init__(self, capacity: int, talker_vocab: int, audio_vocab: int, eos_id: int,
                 device: torch.device | str) -> None:
        self.talker = RowWarpers(capacity, talker_vocab, device)
        self.codebooks = RowWarpers(capacity, audio_vocab, device)
        self.repetition_penalty = torch.ones(capacity, 1, device=device)
        self.seeds = torch.zeros(capacity, dtype=torch.long, device=device)
        self.seen = torch.zeros(capacity, talker_vocab, dtype=torch.bool, device=device)
        self.num_generated = torch.zeros(capacity, dtype=torch.long, device=device)
        suppressed = torch.zeros(talker_vocab, dtype=torch.bool, device=device)
        suppressed[audio_vocab:] = True
        suppressed[eos_id] = False
        self.suppressed = suppressed
        self.eos_column = torch.arange(talker_vocab, device=device) == eos_id

    def set_row(self, row: int, params: ResolvedSampling) -> None:
        self.talker.set_row(row, params.temperature, params.top_k, params.top_p)
        self.codebooks.set_row(row, params.subtalker_temperature, params.subtalker_top_k, params.subtalker_top_p)
        self.repetition_penalty[row] = params.repetition_penalty
        self.seeds[row] = params.seed
        self.seen[row] = False
        self.num_generated[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        self.talker.move_row(src, dst)
        self.codebooks.move_row(src, dst)
        for column in (self.repetition_penalty, self.seeds, self.seen, self.num_generated):
            column[dst] = column[src]

    def noise_keys(self, rows: slice) -> torch.Tensor:
        """[B, STREAMS] the keys of `rows`' draws at their current token index: the next c0's (stream 0) and, since
        the code predictor's token index is the row's c0 count (this frame's c0 included), codebook j's (stream j)."""
        return noise_keys(self.seeds[rows], self.num_generated[rows])

    def paths(self, rows: slice) -> tuple[SamplingPaths, SamplingPaths]:
        """(the talker's, the code predictor's) paths that `rows` need: what an eager step runs."""
        return self.talker.paths_of(rows), self.codebooks.paths_of(rows)

    def static_paths(self, rows: slice) -> SamplingPaths:
        """The path set (of STATIC_PATHS) a static-shape step over `rows` runs for all its draws: CANDIDATES_ONLY
        unless a row's talker or code-predictor draw needs the sorted vocabulary."""
        talker, codebooks = self.paths(rows)
        return ALL_PATHS if talker.full or codebooks.full else CANDIDATES_ONLY

    def sample_talker(self, logits: torch.Tensor, rows: slice, keys: torch.Tensor, paths: SamplingPaths,
                      kernels: ModuleType | None = None) -> torch.Tensor:
        """logits: [B, talker_vocab] for `rows` (B rows) → c0 ids [B] (audio code or EOS), recorded as generated.
        keys: [B] the rows' stream-0 noise keys; paths: what the draw runs (greedy rows take the argmax whatever
        it is); kernels: fused_kernels for the draw, or None (warp_and_sample)."""
        logits = logits.float()
        penalty = self.repetition_penalty[rows]
        penalised = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(self.seen[rows], penalised, logits)
        too_early = (self.num_generated[rows] < MIN_NEW_TOKENS)[:, None] & self.eos_column
        logits = logits.masked_fill(too_early | self.suppressed, float("-inf"))
        ids = warp_and_sample(logits, self.talker.rows(rows), keys, paths, kernels)
        self.seen[rows].scatter_(1, ids[:, None], True)
        self.num_generated[rows] += 1
        return ids
