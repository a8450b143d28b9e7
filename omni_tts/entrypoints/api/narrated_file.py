"""A narrated input's whole file (POST /v1/audio/speech, not streamed, an input longer than one segment). The API
holds a narration's window, never its whole audio: the file is encoded as the audio comes into a spool (memory up to
SPOOL_MEMORY_BYTES, then an unnamed temporary file), each segment is aligned as it ends (NarrationWords), and once
the last audio is in (the headers carry the usage) the file is sent from the spool, in blocks read in the pool. As
JSON (json_body) its `audio` is streamed from the spool in base64."""
from __future__ import annotations

import base64
import json
import tempfile
from typing import AsyncIterator

from aiohttp import web

from omni_tts.audio.encoding import AudioFileWriter, content_type
from omni_tts.entrypoints.api.schema import SpeechRequest
from omni_tts.models.qwen3_tts.audio import SAMPLE_RATE
from omni_tts.orchestrator.types import SegmentEnd, SpeechChunk

from .access_log import request_id
from .responders import record_request_usage, whole_file_headers, whole_file_json, with_first
from .state import ServerState
from .word_times import NarrationWords, header_fields

SPOOL_MEMORY_BYTES = 2**20   # a file up to this size stays in memory; a longer one goes to a temporary file
BLOCK_BYTES = 3 * 2**18          # read and sent at a time (a multiple of 3: each block's base64 stands alone)


async def respond_narrated_file(request: web.Request, state: ServerState, speech: SpeechRequest,
                                first: SpeechChunk, stream: AsyncIterator[SpeechChunk], arrived: float,
                                headers: dict[str, str], json_body: bool = False) -> web.StreamResponse:
    """Nothing is sent before the last audio: an error meanwhile is the answer (error_middleware renders it)."""
    with tempfile.SpooledTemporaryFile(SPOOL_MEMORY_BYTES) as spool:
        writer = await state.run(AudioFileWriter, spool, speech.response_format, SAMPLE_RATE, speech.sample_rate)
        words = NarrationWords(state, request_id(request), speech.language) if speech.word_timestamps else None
        try:
            last, ends, num_samples = first, [], 0
            async for chunk in with_first(first, stream):
                if isinstance(chunk.segment, SegmentEnd):
                    ends.append(chunk.segment)
                if words is not None:
                    await words.take(chunk)
                if chunk.audio.size:
                    await state.run(writer.write, chunk.audio)
                    num_samples += chunk.audio.shape[0]
                last = chunk
            await state.run(writer.finish)
            result = await words.result() if words is not None else None
        finally:
            writer.close()   # after finish: nothing to free
            if words is not None:
                words.close()
        record_request_usage(request, state, last, arrived)
        headers = headers | whole_file_headers(last, num_samples / SAMPLE_RATE, ends)
        size = spool.tell()
        spool.seek(0)
        if not json_body:
            if result is not None:
                headers |= header_fields(result)
            response = web.StreamResponse(headers=headers | {"Content-Type": content_type(speech.response_format)})
            response.content_length = size
            await response.prepare(request)
            await _send(state, response, spool, size, lambda block: block)
        else:
            head, tail = b'{"audio": "', b'", ' + json.dumps(whole_file_json(speech, last, ends, result))[1:].encode()
            response = web.StreamResponse(headers=headers | {"Content-Type": "application/json"})
            response.content_length = len(head) + 4 * -(-size // 3) + len(tail)
            await response.prepare(request)
            await response.write(head)
            await _send(state, response, spool, size, base64.b64encode)
            await response.write(tail)
        await response.write_eof()
        return response


async def _send(state: ServerState, response: web.StreamResponse, spool, size: int, encode) -> None:
    sent = 0
    while sent < size:
        block = await state.run(spool.read, BLOCK_BYTES)
        sent += len(block)
        await response.write(encode(block))
