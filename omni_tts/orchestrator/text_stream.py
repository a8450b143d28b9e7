"""A request whose text arrives in pieces (`AsyncTTSEngine.open_text_stream`): one utterance in the streaming
prompt layout, started in the talker as soon as its text allows and fed the rest as it comes.

    stream = await engine.open_text_stream(SynthesisRequest(text="", voice="ryan"))
    await stream.append("Hello, wor")          # e.g. an LLM's tokens as they arrive
    await stream.append("ld!")
    await stream.finish()
    async for chunk in stream: ...              # concurrently with the appends

The text is tokenized incrementally (ids as soon as no later text can change them, equal to the whole text's). The
request enters the stages with its first text ids (AddRequest, text open); stage 0 starts it when its prefill's
text is there, and each later piece goes as AppendText, the last with `done` and the token limit of the whole text.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, AsyncIterator, Callable

from omni_tts.engine.token_limit import token_limit
from omni_tts.models.qwen3_tts.incremental_tokenizer import IncrementalTokenizer
from omni_tts.models.qwen3_tts.prompt import RequestError, TalkerPrompt
from omni_tts.models.qwen3_tts.sampling import ResolvedSampling
from omni_tts.models.qwen3_tts.text_tokenizer import EMPTY_INPUT, TEMPLATE_HEAD_TOKENS
from omni_tts.stages.protocol import AppendText

from .types import GenerationChunk

if TYPE_CHECKING:
    from .async_engine import AsyncTTSEngine, _Request


class TextStream:
    """One request whose text arrives in pieces: `append`, then `finish`; iterate for its audio. Not for concurrent
    appends. `aclose` (or leaving `async with`) aborts it unless it ended."""

    def __init__(self, engine: "AsyncTTSEngine", request_id: str, state: "_Request", prompt: TalkerPrompt,
                 sampling: ResolvedSampling, ref_audio: bytes | None, output_dtype: str,
                 initial_chunk_frames: int | None, voice_key: str | None, first_audio_timeout: float | None,
                 idle_timeout: float) -> None:
        self.engine, self.request_id, self.state, self.prompt = engine, request_id, state, prompt
        self.sampling, self.ref_audio, self.voice_key = sampling, ref_audio, voice_key
        self.initial_chunk_frames = initial_chunk_frames
        self.first_audio_timeout, self.idle_timeout = first_audio_timeout, idle_timeout
        self.tokenizer = IncrementalTokenizer(engine.prompts.tokenizer)
        self.ids: list[int] = []       # role ids, then text ids, as they became final
        self.in_stages = False         # its AddRequest went out
        self.text_done = False
        self.chunks = engine._audio(request_id, state, output_dtype)

    async def append(self, text: str) -> None:
        """Add a piece of the text. RequestError when the text outgrows the talker's limits (the request fails
        with it)."""
        if self.text_done:
            raise RuntimeError("the text has been finished")
        self.wait_for_text()
        await self._send(await self._tokenize(self.tokenizer.feed, text), done=False)

    async def finish(self) -> None:
        """End the text: what was held back goes out, with tts_eos and the whole text's token limit."""
        if self.text_done:
            return
        self.text_done = True
        ids = await self._tokenize(self.tokenizer.finish)
        deadline = self.state.deadlines.pop("idle", None)
        if deadline is not None:
            deadline.cancel()
        if self.tokenizer.is_blank:
            raise self._fail(RequestError("input", EMPTY_INPUT))
        await self._send(ids, done=True)
        if self.first_audio_timeout is not None and self.state.num_samples == 0:
            self.engine._set_deadline(self.request_id, self.state, "first_audio",
                                      self._now() + self.first_audio_timeout,
                                      f"no audio within {self.first_audio_timeout:g} s of the text's end")

    def wait_for_text(self) -> None:
        """(Re)start the idle deadline: the request fails if no text comes within idle_timeout."""
        self.engine._set_deadline(self.request_id, self.state, "idle", self._now() + self.idle_timeout,
                                  f"no text for {self.idle_timeout:g} s")

    def __aiter__(self) -> AsyncIterator["GenerationChunk"]:
        return self.chunks

    async def aclose(self) -> None:
        await self.chunks.aclose()
        await self.engine._release(self.request_id, self.state)

    async def __aenter__(self) -> "TextStream":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _tokenize(self, fn: Callable[..., list[int]], *args: str) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self.engine.tokenizer_pool, fn, *args)

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()

    def _fail(self, error: RequestError) -> RequestError:
        self.engine._fail(self.request_id, self.state, error)
        return error

    async def _send(self, ids: list[int], done: bool) -> None:
        if self.engine.requests.get(self.request_id) is not self.state:
            return  # it ended (its end token came before the text's end) or failed: the audio tells which
        new_text = ids[max(0, TEMPLATE_HEAD_TOKENS - len(self.ids)):]
        self.ids += ids
        self.prompt.role_ids, self.prompt.text_ids = self.ids[:TEMPLATE_HEAD_TOKENS], self.ids[TEMPLATE_HEAD_TOKENS:]
        try:
            self.engine.prompts.check_fits(self.prompt)
        except RequestError as e:
            raise self._fail(e) from None
        self.state.input_tokens = len(self.prompt.text_ids)
        limit = token_limit(self.sampling.max_new_tokens, len(self.prompt.text_ids))
        if self.in_stages:
            if new_text or done:
                await self.engine._send(self.state, "talker", AppendText(self.request_id, new_text, limit, done))
        elif self.prompt.text_ids:  # the role ids are known with the first text token
            self.in_stages = True
            await self.engine._send_request(self.request_id, self.state, self.engine._add_request(
                self.request_id, self.prompt, self.sampling, self.ref_audio, limit, self.initial_chunk_frames,
                self.voice_key, text_open=not done))
