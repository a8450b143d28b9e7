"""A Realtime session's conversation: its items (the client's messages and the responses' transcripts), at most
MAX_ITEMS of them (beyond, the oldest go), and the rule of which text a response speaks:

- with `response.input` (in band or out of band): the `input_text` of the last user message in it (an
  `item_reference` read from the conversation), the earlier items being context an LLM would read, not text to say;
- without it: the `input_text` of every user item added since the previous in-band response, in conversation order,
  one line each; an in-band response takes them (the next speaks only newer ones), an out-of-band one leaves them.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgspec

from omni_tts.entrypoints.api.schema import MAX_TEXT_CHARS, ApiError

from .events import ItemReference, MessageItem, new_id

MAX_ITEMS = 128


@dataclass
class Item:
    id: str
    role: str
    content: list[dict]   # as the client sent it (the assistant's: output_audio with its transcript)
    text: str             # what it says: a user item's input_text, an assistant item's transcript
    new: bool = False     # a user item no in-band response has spoken yet

    def json(self, status: str = "completed") -> dict:
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role, "status": status,
                "content": self.content}


def message_text(message: MessageItem) -> str:
    """A message's text; ApiError for content this server cannot take (audio, images; parts that are not text)."""
    texts = []
    for part in message.content:
        if part.type in ("input_audio", "audio"):
            raise ApiError(400, "audio input not supported: this server reads text aloud; send input_text parts",
                           "item.content", "audio_input_not_supported")
        if message.role == "user" and part.type != "input_text":
            raise ApiError(400, f"a user message's content must be input_text parts, not '{part.type}'",
                           "item.content")
        texts.append(part.text or part.transcript or "")
    text = "".join(texts)
    if len(text) > MAX_TEXT_CHARS:   # what one item may hold: a response speaks at most this much
        raise ApiError(400, f"a message may hold at most {MAX_TEXT_CHARS} characters of text", "item.content")
    return text


class Conversation:
    """The items of one session's default conversation."""

    def __init__(self) -> None:
        self.id = new_id("conv")
        self.items: list[Item] = []

    def add(self, message: MessageItem, previous_item_id: str | None) -> tuple[Item, str | None]:
        """The client's message as an item, after `previous_item_id` (None: at the end; "root": first), and the id of
        the item before it."""
        if message.id is not None and self.find(message.id) is not None:
            raise ApiError(400, f"an item with id '{message.id}' exists already", "item.id", "item_id_exists")
        item = Item(message.id or new_id("item"), message.role,
                    [msgspec.to_builtins(part) for part in message.content], message_text(message),
                    new=message.role == "user")
        if previous_item_id is None:
            at = len(self.items)
        elif previous_item_id == "root":
            at = 0
        else:
            at = self.index(previous_item_id, "previous_item_id") + 1
        self.items.insert(at, item)
        previous = self.items[at - 1].id if at > 0 else None
        self._bound()
        return item, previous

    def add_assistant(self, item: Item) -> str | None:
        """A response's item at the end; the id of the item before it."""
        previous = self.items[-1].id if self.items else None
        self.items.append(item)
        self._bound()
        return previous

    def delete(self, item_id: str) -> None:
        del self.items[self.index(item_id, "item_id")]

    def find(self, item_id: str) -> Item | None:
        return next((item for item in self.items if item.id == item_id), None)

    def index(self, item_id: str, param: str) -> int:
        for at, item in enumerate(self.items):
            if item.id == item_id:
                return at
        raise ApiError(400, f"no item with id '{item_id}' in the conversation", param, "item_not_found")

    def new_text(self, take: bool) -> str:
        """The text of the user items added since the previous in-band response, one line each; `take`: an in-band
        response speaks them, so the next one does not."""
        new = [item for item in self.items if item.new]
        if take:
            for item in new:
                item.new = False
        return "\n".join(item.text for item in new if item.text)

    def input_text(self, items: list[MessageItem | ItemReference]) -> str:
        """The text a response's own `input` speaks: its last user message's (checking every message as
        conversation.item.create would)."""
        text = ""
        for entry in items:
            if isinstance(entry, ItemReference):
                item = self.items[self.index(entry.id, "response.input")]
                role, said = item.role, item.text
            else:
                role, said = entry.role, message_text(entry)
            if role == "user":
                text = said
        return text

    def _bound(self) -> None:
        if len(self.items) > MAX_ITEMS:
            del self.items[0]
