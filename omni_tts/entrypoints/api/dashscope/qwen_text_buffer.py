"""A realtime session's text that no response has taken yet, and where its responses end.

`commit` mode: nothing is spoken before `input_text_buffer.commit`; each commit is one response of exactly the text
committed. `server_commit` mode (DashScope's default): text goes to the response being spoken as it arrives, so audio
starts before any commit, and a response ends at the end of its first sentence (orchestrator/text_splitter's rule),
at a commit or `session.finish` (which end the text so far), or once it holds MAX_TEXT_CHARS (at the last space
before); its text starts at its first word. A sentence per response keeps every request within the talker's length
whatever a client streams without committing (an agent's reply; DashScope's own sample never commits), ends each
with its `response.done`, and costs no gap: the next sentence's text waits here while the previous one's audio is
made, faster than it plays.
"""
from __future__ import annotations

from collections import deque

from omni_tts.entrypoints.api.schema import MAX_TEXT_CHARS, ApiError
from omni_tts.orchestrator.text_splitter import SENTENCE_MARKS, unit_ends

from ..speech_turn import check_text_length

MAX_BUFFERED_CHARS = 4 * MAX_TEXT_CHARS   # text waiting for its response, beside the one being spoken


class TextBuffer:
    def __init__(self, mode: str) -> None:
        self.server_commit = mode == "server_commit"
        self.segments: deque[str] = deque()   # texts each of which ends its response (a commit, the finish)
        self.tail = ""                        # the text after the last of them
        self.appended = False                 # since the last commit

    def append(self, text: str) -> None:
        waiting = len(self.tail) + sum(map(len, self.segments)) + len(text)
        if waiting > MAX_BUFFERED_CHARS:
            raise ApiError(400, f"{waiting} characters would wait to be spoken; at most {MAX_BUFFERED_CHARS} may: "
                                f"wait for response.done (or clear the buffer)", "text")
        self.tail += text
        if not self.server_commit:
            check_text_length(self.tail)   # a response's text: committed whole
        self.appended = True

    def commit(self, accepting: bool) -> None:
        """The text so far ends a response; `accepting`: a response takes text (server_commit), which this ends.
        ApiError 400 for a commit with nothing to speak."""
        if not (self.tail.strip() if not self.server_commit else self.appended):
            raise ApiError(400, "the input text buffer is empty: append text before committing", "text")
        self.flush(accepting)
        self.appended = False

    def flush(self, accepting: bool) -> None:
        """`session.finish`: what was appended is spoken too, committed or not."""
        if self.tail.strip() or (accepting and self.server_commit):
            self.segments.append(self.tail)
        self.tail = ""

    def clear(self) -> None:
        """Drop what no response has taken (a response being spoken keeps its text)."""
        self.segments.clear()
        self.tail, self.appended = "", False

    def has_next(self) -> bool:
        """Whether there is text for a new response."""
        return bool(self.segments) or (self.server_commit and bool(self.tail.strip()))

    def take(self, spoken: str) -> tuple[str, bool] | None:
        """The next piece for the response that holds `spoken` so far, and whether it ends that response; None
        when there is none yet. In server_commit mode a response's text starts at its first word, and committed
        text too ends a response at each sentence end."""
        if not self.server_commit:
            return (self.segments.popleft(), True) if self.segments else None
        if self.segments:
            text = self.segments[0] if spoken else self.segments[0].lstrip()
            end = self._end(spoken, text, final=True)
            if end is None or not text[end:].strip():
                self.segments.popleft()
                return (text if end is None else text[:end]), True
            self.segments[0] = text[end:]
            return text[:end], True
        if not spoken:
            self.tail = self.tail.lstrip()
        if not self.tail:
            return None
        end = self._end(spoken, self.tail, final=False)
        if end is None:
            text, self.tail = self.tail, ""
            return text, False
        text, self.tail = self.tail[:end], self.tail[end:]
        return text, True

    @staticmethod
    def _end(spoken: str, text: str, final: bool) -> int | None:
        """Where in `text` the response that holds `spoken` ends: its first sentence's end (the mark may have been
        spoken already), else the last space that keeps it within MAX_TEXT_CHARS; None: not (yet) in `text`."""
        end = next(unit_ends(spoken + text, SENTENCE_MARKS, final), None)
        end = None if end is None else max(end - len(spoken), 0)
        room = MAX_TEXT_CHARS - len(spoken)
        if (end is None or end > room) and len(text) > room:
            end = text.rfind(" ", 0, room)
            end = end if end > 0 else room
        return end
