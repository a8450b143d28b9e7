"""The OpenAPI paths and schemas of /v1/pronunciation-dictionaries (dictionary_routes.py), which openapi.py adds to
the server's document."""
from __future__ import annotations

import msgspec

from omni_tts.entrypoints.api.response_schemas import SCHEMAS
from omni_tts.entrypoints.api.schema import MAX_NAME_CHARS

from .dictionary_routes import PREFIX, AddFromRules, RulesBody, RuleStrings
from .rules_file import MAX_FILE_BYTES

_STRING, _INT = {"type": "string"}, {"type": "integer"}
_NULLABLE_STRING = {"type": ["string", "null"]}
ELEVENLABS_ERROR = {"type": "object", "required": ["detail"], "properties": {"detail": {
    "type": "object", "required": ["status", "message"],
    "properties": {"status": _STRING, "message": _STRING, "param": _NULLABLE_STRING, "request_id": _STRING}}}}
_METADATA_FIELDS = {"id": _STRING, "latest_version_id": _STRING, "latest_version_rules_num": _INT, "name": _STRING,
                    "permission_on_resource": _STRING, "created_by": _STRING, "creation_time_unix": _INT,
                    "archived_time_unix": {"type": ["integer", "null"]}, "description": _NULLABLE_STRING}
METADATA = {"type": "object", "required": ["id", "latest_version_id", "latest_version_rules_num", "name",
                                           "created_by", "creation_time_unix"], "properties": _METADATA_FIELDS}
RULE = {"type": "object", "required": ["type", "string_to_replace", "alias"], "properties": {
    "type": {"const": "alias"}, "string_to_replace": _STRING, "alias": _STRING, "case_sensitive": {"type": "boolean"},
    "word_boundaries": {"type": "boolean"}}}
SCHEMA_NAMES = {"AddFromRules": "PronunciationDictionaryFromRules", "RulesBody": "PronunciationRules",
                "RuleStrings": "PronunciationRuleStrings", "RuleBody": "PronunciationRule"}


def _json(schema: dict | str, description: str) -> dict:
    ref = {"$ref": SCHEMAS + schema} if isinstance(schema, str) else schema
    return {"description": description, "content": {"application/json": {"schema": ref}}}


def _error(description: str) -> dict:
    return _json("ElevenLabsError", description)


def pronunciation_schemas() -> dict:
    (_, _, _), schemas = msgspec.json.schema_components(
        [AddFromRules, RulesBody, RuleStrings], ref_template=SCHEMAS + "{name}")
    text = msgspec.json.encode(schemas).decode()
    for name, documented in SCHEMA_NAMES.items():   # names of their own in the server's document
        text = text.replace(f'"{SCHEMAS}{name}"', f'"{SCHEMAS}{documented}"')
    schemas = {SCHEMA_NAMES[name]: schema for name, schema in msgspec.json.decode(text).items()}
    created = {"type": "object", "required": ["id", "name", "created_by", "creation_time_unix", "version_id",
                                              "version_rules_num"],
               "properties": {**{k: v for k, v in _METADATA_FIELDS.items() if not k.startswith(("latest", "arch"))},
                              "version_id": _STRING, "version_rules_num": _INT}}
    changed = {"type": "object", "required": ["id", "version_id", "version_rules_num"],
               "properties": {"id": _STRING, "version_id": _STRING, "version_rules_num": _INT}}
    return schemas | {
        "ElevenLabsError": ELEVENLABS_ERROR, "PronunciationDictionaryCreated": created,
        "PronunciationDictionaryChanged": changed, "PronunciationDictionaryMetadata": METADATA,
        "PronunciationDictionary": {"allOf": [{"$ref": SCHEMAS + "PronunciationDictionaryMetadata"}, {
            "type": "object", "required": ["rules"], "properties": {"rules": {"type": "array", "items": RULE}}}]},
        "PronunciationDictionaryList": {"type": "object", "required": ["pronunciation_dictionaries", "has_more"],
                                        "properties": {"pronunciation_dictionaries": {"type": "array", "items": {
                                            "$ref": SCHEMAS + "PronunciationDictionaryMetadata"}},
                                            "next_cursor": _NULLABLE_STRING, "has_more": {"type": "boolean"}}}}


def pronunciation_paths() -> dict:
    dictionary_id = {"name": "id", "in": "path", "required": True, "schema": _STRING}
    bad_rules = _error("an invalid body, or a phoneme rule (Qwen3-TTS reads text: only alias rules apply)")
    missing = _error("no such dictionary")
    full = _error("the dictionaries would exceed their bounds (count or size)")

    def change(operation: str, summary: str, body: str) -> dict:
        return {"post": {"operationId": operation, "summary": summary, "parameters": [dictionary_id],
                         "requestBody": {"required": True, "content": {"application/json": {
                             "schema": {"$ref": SCHEMAS + body}}}},
                         "responses": {"200": _json("PronunciationDictionaryChanged", "the new latest version"),
                                       "400": bad_rules, "404": missing, "413": full}}}

    form = {"type": "object", "required": ["name", "file"], "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": MAX_NAME_CHARS}, "description": _STRING,
        "workspace_access": _STRING,
        "file": {"type": "string", "contentMediaType": "application/octet-stream",
                 "description": f"a PLS lexicon (no DOCTYPE or entities) or JSON rules, at most {MAX_FILE_BYTES} "
                                "bytes"}}}
    return {
        f"{PREFIX}/add-from-file": {"post": {
            "operationId": "addPronunciationDictionaryFromFile", "summary": "A pronunciation dictionary from a PLS "
                                                                          "lexicon's alias lexemes (ElevenLabs)",
            "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": form}}},
            "responses": {"200": _json("PronunciationDictionaryCreated", "created"),
                          "400": _error("an invalid form or file (malformed, a DOCTYPE or entity, a lexeme without "
                                        "alias)"),
                          "413": _error("the file is too large, or the dictionaries would exceed their bounds")}}},
        f"{PREFIX}/add-from-rules": {"post": {
            "operationId": "addPronunciationDictionaryFromRules",
            "summary": "A pronunciation dictionary from alias rules (ElevenLabs)",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": {"$ref": SCHEMAS + "PronunciationDictionaryFromRules"}}}},
            "responses": {"200": _json("PronunciationDictionaryCreated", "created"), "400": bad_rules,
                          "413": full}}},
        PREFIX: {"get": {
            "operationId": "listPronunciationDictionaries", "summary": "The pronunciation dictionaries, newest first",
            "parameters": [{"name": "page_size", "in": "query", "schema": {"type": "integer", "minimum": 1,
                                                                           "maximum": 100}},
                           {"name": "cursor", "in": "query", "schema": _STRING},
                           {"name": "sort", "in": "query", "schema": {"enum": ["creation_time_unix", "name"]}},
                           {"name": "sort_direction", "in": "query", "schema": {"enum": ["ascending",
                                                                                         "descending"]}}],
            "responses": {"200": _json("PronunciationDictionaryList", "a page of dictionaries"),
                          "400": _error("page_size or cursor out of range")}}},
        f"{PREFIX}/{{id}}": {"get": {
            "operationId": "getPronunciationDictionary", "summary": "A dictionary with its latest version's rules",
            "parameters": [dictionary_id],
            "responses": {"200": _json("PronunciationDictionary", "the dictionary"), "404": missing}}},
        f"{PREFIX}/{{id}}/add-rules": change("addPronunciationRules", "Add rules (one whose string_to_replace the "
                                             "dictionary has replaces it): a new version", "PronunciationRules"),
        f"{PREFIX}/{{id}}/remove-rules": change("removePronunciationRules", "Remove the rules of these strings: a "
                                                "new version", "PronunciationRuleStrings"),
        f"{PREFIX}/{{id}}/set-rules": change("setPronunciationRules", "Replace every rule: a new version",
                                             "PronunciationRules"),
    }
