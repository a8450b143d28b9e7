"""Offline batched generation: prompts → codec frames [T, 16], following the reference loop exactly (§8).

Step order: prefill → c0[0]; then per step the code predictor completes frame t from (h_t, c0[t]), the talker is
fed Σ16(frame t) + trailing text row t, and samples c0[t+1]. N sampled tokens give at most N − 1 frames; a row
ends at its first EOS (then it is fed EOS as padding) or at its token limit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import Qwen3TTSConfig
from .layers import KVCache
from .sampling import BatchSampler, ResolvedSampling
from .talker import Talker

# protection against a model that never emits EOS: a token limit of max(floor, per_text_token × text tokens)
TOKEN_CAP_FLOOR = 192
TOKEN_CAP_PER_TEXT_TOKEN = 12


@dataclass
class GeneratedCodes:
    codes: torch.Tensor   # [T, 16] int64 on the CPU
    finish_reason: str    # "stop" (EOS) or "length" (token limit)


def token_limit(max_new_tokens: int, num_text_tokens: int, cap_floor: int | None = TOKEN_CAP_FLOOR,
                cap_per_text_token: int = TOKEN_CAP_PER_TEXT_TOKEN) -> int:
    """min(requested or configured max_new_tokens, max(cap_floor, cap_per_text_token × text tokens));
    cap_floor None disables the cap."""
    if cap_floor is None:
        return max_new_tokens
    return min(max_new_tokens, max(cap_floor, cap_per_text_token * num_text_tokens))


@torch.no_grad()
def generate_codes(talker: Talker, config: Qwen3TTSConfig, prefills: list[torch.Tensor],
                   trailings: list[torch.Tensor], params: list[ResolvedSampling],
                   limits: list[int]) -> list[GeneratedCodes]:
    """prefills[i]: [L_i, H]; trailings[i]: [T_i, H]; limits[i]: max sampled tokens. One batch, left-padded."""
    tc = config.talker
    device, dtype = prefills[0].device, prefills[0].dtype
    batch, hidden_size = len(prefills), tc.hidden_size
    prompt_len = max(p.shape[0] for p in prefills)
    max_steps = max(limits)
    cache = KVCache(tc, batch, prompt_len + max_steps, device, dtype)
    cp_cache = KVCache(tc.code_predictor, batch, tc.num_code_groups, device, dtype)

    embeds = torch.zeros(batch, prompt_len, hidden_size, device=device, dtype=dtype)
    key_valid = torch.zeros(batch, cache.max_len, dtype=torch.bool, device=device)
    tts_pad = talker.embed_text(torch.tensor(config.tts_pad_token_id, device=device)).to(dtype)
    trailing = tts_pad.expand(batch, max(t.shape[0] for t in trailings), hidden_size).clone()
    for i, (prefill, rows) in enumerate(zip(prefills, trailings)):
        embeds[i, prompt_len - prefill.shape[0]:] = prefill
        key_valid[i, prompt_len - prefill.shape[0]:prompt_len] = True
        trailing[i, :rows.shape[0]] = rows
    positions = (key_valid[:, :prompt_len].long().cumsum(-1) - 1).clamp(min=0)

    sampler = BatchSampler.for_batch(params, tc.vocab_size, tc.code_predictor.vocab_size, tc.codec_eos_token_id, device)
    rows = slice(0, batch)
    hidden, logits = talker(embeds, positions, cache, 0, key_valid)
    c0 = sampler.sample_talker(logits, rows)
    next_position = positions[:, -1] + 1
    eos = tc.codec_eos_token_id
    frames: list[torch.Tensor] = []
    num_frames = [None] * batch
    reasons = ["length"] * batch
    for step in range(max_steps):
        tokens = c0.tolist()
        for i in range(batch):
            if num_frames[i] is None and (tokens[i] == eos or step + 1 >= limits[i]):
                num_frames[i] = step
                reasons[i] = "stop" if tokens[i] == eos else "length"
        if all(n is not None for n in num_frames):
            break
        rest = talker.code_predictor.predict(hidden, talker.embed_codec(c0), cp_cache, sampler.codebook_sampler(rows))
        frame = torch.cat((c0[:, None], rest), dim=1)
        frames.append(frame)
        row = trailing[:, step] if step < trailing.shape[1] else tts_pad.expand(batch, hidden_size)
        x = (talker.embed_frame(frame) + row)[:, None]
        slot = prompt_len + step
        key_valid[:, slot] = True
        hidden, logits = talker(x, next_position[:, None], cache, slot, key_valid)
        next_position = next_position + 1
        done = torch.tensor([n is not None for n in num_frames], device=device)
        c0 = torch.where(done, torch.full_like(c0, eos), sampler.sample_talker(logits, rows))
    stacked = torch.stack(frames, dim=1).cpu() if frames else torch.zeros(batch, 0, 16, dtype=torch.long)
    return [GeneratedCodes(codes=stacked[i, :num_frames[i]].clone(), finish_reason=reasons[i]) for i in range(batch)]
