"""A request's token limit: what it asks for, capped by the length of its text.

A model that never emits EOS would otherwise run to `max_new_tokens` (8192 by default, minutes of audio) on any
text; speech runs at a bounded number of frames per text token, so a cap proportional to the text ends such a run
without cutting real speech.
"""
from __future__ import annotations

TOKEN_CAP_FLOOR = 192
TOKEN_CAP_PER_TEXT_TOKEN = 12


def token_limit(max_new_tokens: int, num_text_tokens: int, cap_floor: int | None = TOKEN_CAP_FLOOR,
                cap_per_text_token: int = TOKEN_CAP_PER_TEXT_TOKEN) -> int:
    """min(requested or configured max_new_tokens, max(cap_floor, cap_per_text_token × text tokens));
    cap_floor None disables the cap."""
    if cap_floor is None:
        return max_new_tokens
    return min(max_new_tokens, max(cap_floor, cap_per_text_token * num_text_tokens))
