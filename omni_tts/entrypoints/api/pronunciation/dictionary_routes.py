"""ElevenLabs' /v1/pronunciation-dictionaries routes, in the shapes its `elevenlabs` SDK reads: add from a PLS file
(multipart) or from JSON rules, list, get (with the latest version's rules), and add, remove or set rules (each a new
version). Errors are ElevenLabs' `{"detail": ...}` (errors.ERROR_BODIES)."""
from __future__ import annotations

import contextlib
from typing import Annotated

import aiohttp
import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from omni_tts.entrypoints.api.schema import MAX_NAME_CHARS, MAX_TEXT_CHARS, ApiError, Name, decode_json
from omni_tts.entrypoints.api.state import STATE, ServerState
from omni_tts.entrypoints.api.voice_form import read_part
from omni_tts.models.qwen3_tts.lexicon import AliasRule

from .rules_file import MAX_FILE_BYTES, Rules, RulesError, alias_rules, parse_rules_file
from .dictionaries import Dictionary

PREFIX = "/v1/pronunciation-dictionaries"
Description = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
_FORM = ("the body must be multipart/form-data with the fields name and file (a PLS lexicon or JSON rules), and "
         "optionally description and workspace_access")
_FORM_FIELDS = {"name", "description", "workspace_access", "file"}


class AddFromRules(msgspec.Struct, kw_only=True):
    rules: Rules
    name: Name
    description: Description | None = None
    workspace_access: str | None = None   # ElevenLabs' workspace sharing: one user here, ignored


class RulesBody(msgspec.Struct):
    rules: Rules


class RuleStrings(msgspec.Struct):
    rule_strings: Annotated[list[str], msgspec.Meta(max_length=MAX_TEXT_CHARS)]


async def add_from_file(request: web.Request) -> web.Response:
    fields = await _read_form(request)
    if not isinstance(fields.get("name"), str) or not fields["name"].strip() or len(fields["name"]) > MAX_NAME_CHARS:
        raise ApiError(400, f"the field 'name' is required, at most {MAX_NAME_CHARS} characters; {_FORM}", "name")
    if "file" not in fields:
        raise ApiError(400, f"the field 'file' is required; {_FORM}", "file")
    state = request.app[STATE]
    try:
        rules = await state.run(parse_rules_file, fields["file"])
    except RulesError as e:
        raise ApiError(400, str(e), "file") from None
    return await _created(state, fields["name"], fields.get("description"), rules)


async def add_from_rules(request: web.Request) -> web.Response:
    body = decode_json(await request.read(), AddFromRules)
    return await _created(request.app[STATE], body.name, body.description, _alias_rules(body.rules))


async def list_dictionaries(request: web.Request) -> web.Response:
    """Newest first (or by name), `page_size` (1..100, default 30) at a time; `cursor` is where the next page
    starts."""
    store, query = request.app[STATE].pronunciation, request.query
    try:
        page_size, start = int(query.get("page_size", 30)), int(query.get("cursor") or 0)
    except ValueError:
        raise ApiError(400, "page_size and cursor must be integers", "page_size") from None
    if not 1 <= page_size <= 100 or start < 0:
        raise ApiError(400, "page_size must be within 1..100 and cursor not negative", "page_size")
    sort, direction = query.get("sort", "creation_time_unix"), query.get("sort_direction", "descending")
    if sort not in ("creation_time_unix", "name") or direction not in ("ascending", "descending"):
        raise ApiError(400, "sort must be creation_time_unix or name, sort_direction ascending or descending",
                       "sort")
    found = sorted(store.dictionaries.values(), key=lambda d: (d.creation_time_unix if sort != "name" else d.name),
                   reverse=direction == "descending")
    page, more = found[start:start + page_size], start + page_size < len(found)
    return web.json_response({"pronunciation_dictionaries": [d.metadata() for d in page],
                              "next_cursor": str(start + page_size) if more else None, "has_more": more})


async def get_dictionary(request: web.Request) -> web.Response:
    dictionary = request.app[STATE].pronunciation.get(request.match_info["id"])
    return web.json_response({**dictionary.metadata(), "rules": [_rule_json(r) for r in dictionary.latest.rules]})


async def add_rules(request: web.Request) -> web.Response:
    """ElevenLabs': a rule whose string_to_replace the dictionary has replaces it."""
    state, added = request.app[STATE], _alias_rules(decode_json(await request.read(), RulesBody).rules)
    dictionary = state.pronunciation.get(request.match_info["id"])
    replaced = {rule.grapheme for rule in added}
    kept = [rule for rule in dictionary.latest.rules if rule.grapheme not in replaced]
    return await _changed(state, dictionary.id, kept + added)


async def remove_rules(request: web.Request) -> web.Response:
    state, body = request.app[STATE], decode_json(await request.read(), RuleStrings)
    dictionary = state.pronunciation.get(request.match_info["id"])
    gone = set(body.rule_strings)
    return await _changed(state, dictionary.id, [r for r in dictionary.latest.rules if r.grapheme not in gone])


async def set_rules(request: web.Request) -> web.Response:
    state, body = request.app[STATE], decode_json(await request.read(), RulesBody)
    return await _changed(state, request.match_info["id"], _alias_rules(body.rules))


def _alias_rules(bodies: Rules) -> list[AliasRule]:
    try:
        return alias_rules(bodies)
    except RulesError as e:
        raise ApiError(400, str(e), "rules") from None


async def _created(state: ServerState, name: str, description: str | None, rules: list[AliasRule]) -> web.Response:
    with _write_slot(state):
        dictionary = state.pronunciation.create(name.strip(), description, rules)
        await _save(state, dictionary)
    return web.json_response({"id": dictionary.id, "name": dictionary.name, "created_by": "omni-tts",
                              "creation_time_unix": dictionary.creation_time_unix,
                              "version_id": dictionary.latest.version_id, "version_rules_num": len(rules),
                              "description": dictionary.description, "permission_on_resource": "admin"})


async def _changed(state: ServerState, dictionary_id: str, rules: list[AliasRule]) -> web.Response:
    with _write_slot(state):
        dictionary = state.pronunciation.change(dictionary_id, rules)
        await _save(state, dictionary)
    return web.json_response({"id": dictionary.id, "version_id": dictionary.latest.version_id,
                              "version_rules_num": len(rules)})


def _write_slot(state: ServerState) -> contextlib.AbstractContextManager:
    """A place among the voice store's writes (429 beyond), taken before the change, when the change is written."""
    return state.voice_write_slot() if state.pronunciation.folder is not None else contextlib.nullcontext()


async def _save(state: ServerState, dictionary: Dictionary) -> None:
    """Onto --voices-dir, one write at a time (the voice store's writer: file I/O off the loop), in the order of
    the changes, so the file ends as the last change left the dictionary."""
    if state.pronunciation.folder is not None:
        await state.write_voices(state.pronunciation.save, dictionary)


def _rule_json(rule: AliasRule) -> dict:
    return {"type": "alias", "string_to_replace": rule.grapheme, "alias": rule.alias,
            "case_sensitive": rule.case_sensitive, "word_boundaries": rule.word_boundaries}


async def _read_form(request: web.Request) -> dict[str, str | bytes]:
    """add-from-file's form: name, description, workspace_access (text) and file (bytes, at most MAX_FILE_BYTES)."""
    if request.content_type != "multipart/form-data":
        raise ApiError(400, _FORM)
    fields: dict[str, str | bytes] = {}
    try:
        async for part in await request.multipart():
            if not isinstance(part, aiohttp.BodyPartReader) or part.name not in _FORM_FIELDS:
                raise ApiError(400, f"unexpected multipart field {getattr(part, 'name', None)!r}; {_FORM}")
            if part.name in fields:
                raise ApiError(400, f"multipart field '{part.name}' is given more than once", part.name)
            data = await read_part(part, MAX_FILE_BYTES if part.name == "file" else MAX_TEXT_CHARS * 4, part.name)
            try:
                fields[part.name] = data if part.name == "file" else data.decode("utf-8")
            except UnicodeDecodeError:
                raise ApiError(400, f"multipart field '{part.name}' is not valid UTF-8", part.name) from None
    except (ValueError, HttpProcessingError):   # what aiohttp's parser raises for a malformed body
        raise ApiError(400, _FORM) from None
    return fields


PRONUNCIATION_ROUTES = [
    web.post(f"{PREFIX}/add-from-file", add_from_file),
    web.post(f"{PREFIX}/add-from-rules", add_from_rules),
    web.get(PREFIX, list_dictionaries),
    web.get(f"{PREFIX}/{{id}}", get_dictionary),
    web.post(f"{PREFIX}/{{id}}/add-rules", add_rules),
    web.post(f"{PREFIX}/{{id}}/remove-rules", remove_rules),
    web.post(f"{PREFIX}/{{id}}/set-rules", set_rules),
]
