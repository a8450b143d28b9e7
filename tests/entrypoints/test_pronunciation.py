"""Pronunciation dictionaries against a real server: uploaded with the official `elevenlabs` SDK (PLS and JSON
rules), set per request (/v1/audio/speech, the batch route, our WebSocket), per voice and for the whole server on the
command line; the greedy audio of a text with a rule equals the audio of its replacement sent plainly; word
timestamps spell the words the client sent (test_word_timestamps.py, on its server with the aligner); bad
dictionaries are refused in ElevenLabs' error shape.

One server of its own (module-scoped): it needs --pronunciation-dictionary, --voice-pronunciation-dictionary and
--voices-dir together, which no shared server has."""
import base64
import json
import subprocess
import sys

import pytest
from elevenlabs import ElevenLabs
from elevenlabs.core import ApiError as ElevenLabsError

from conftest import FIXTURES
from omni_tts.entrypoints.api.pronunciation.dictionaries import (MAX_DICTIONARIES, MAX_VERSIONS,
                                                                  PronunciationDictionaries)
from omni_tts.entrypoints.api.schema import ApiError, PronunciationLocator
from omni_tts.models.qwen3_tts.lexicon import AliasRule
from omni_tts.entrypoints.api.pronunciation.rules_file import MAX_FILE_BYTES
from server_util import ServerProcess, free_port, request, ws_utterance

GREEDY = {"temperature": 0.0, "max_new_tokens": 24, "voice": "vivian", "response_format": "pcm",
          "non_streaming_mode": False}
PLS = """<?xml version="1.0" encoding="UTF-8"?>
<lexicon version="1.0" xmlns="http://www.w3.org/2005/01/pronunciation-lexicon" alphabet="ipa" xml:lang="en-US">
  <lexeme><grapheme>TTS</grapheme><alias>text to speech</alias></lexeme>
  <lexeme><grapheme>nginx</grapheme><grapheme>NGINX</grapheme><alias>engine x</alias>
          <phoneme>ˈɛndʒɪnˈɛks</phoneme></lexeme>
</lexicon>"""
SERVER_PLS = PLS.replace("TTS", "Qwen").replace("text to speech", "chwen").split("<lexeme><grapheme>nginx")[0] + \
    "</lexicon>"


def pls(*lexemes: str, prolog: str = "") -> bytes:
    return (f'<?xml version="1.0"?>{prolog}<lexicon version="1.0" '
            f'xmlns="http://www.w3.org/2005/01/pronunciation-lexicon">{"".join(lexemes)}</lexicon>').encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pronunciation")
    (folder / "server.pls").write_text(SERVER_PLS)
    (folder / "ryan.json").write_text(json.dumps([{"type": "alias", "string_to_replace": "Bob", "alias": "Robert"}]))
    server = ServerProcess("--model", str(FIXTURES / "tiny-custom-voice"), "--voices-dir", str(folder / "voices"),
                           "--pronunciation-dictionary", str(folder / "server.pls"),
                           "--voice-pronunciation-dictionary", f"ryan={folder / 'ryan.json'}")
    server.voices_dir = folder / "voices"
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return ElevenLabs(base_url=server.url, api_key="unused")


@pytest.fixture(scope="module")
def tts_rules(client):
    """A dictionary from JSON rules: TTS → text to speech."""
    return client.pronunciation_dictionaries.create_from_rules(name="acronyms", rules=[
        {"type": "alias", "string_to_replace": "TTS", "alias": "text to speech"}])


def speech(server, text: str, **fields) -> bytes:
    status, _, body = request(server.url + "/v1/audio/speech", dict(GREEDY, input=text, **fields))
    assert status == 200, body[:300]
    return body


def locators(*dictionaries) -> dict:
    return {"pronunciation_dictionary_locators": [{"pronunciation_dictionary_id": d.id} for d in dictionaries]}


def test_the_sdk_uploads_pls_and_json_rules_kept_under_the_voices_dir(server, client, tts_rules):
    created = client.pronunciation_dictionaries.create_from_file(name="from pls", file=PLS.encode(),
                                                                 description="a lexicon")
    assert created.version_rules_num == 3   # one rule a grapheme; a lexeme's phoneme beside its alias is unused
    got = client.pronunciation_dictionaries.get(created.id)
    assert got.latest_version_id == created.version_id and got.description == "a lexicon"
    assert [(r.string_to_replace, r.alias, r.case_sensitive) for r in got.rules] == [
        ("TTS", "text to speech", True), ("nginx", "engine x", True), ("NGINX", "engine x", True)]
    listed = {d.id: d for d in client.pronunciation_dictionaries.list().pronunciation_dictionaries}
    assert listed[tts_rules.id].name == "acronyms" and listed[created.id].latest_version_rules_num == 3
    added = client.pronunciation_dictionaries.rules.add(created.id, rules=[
        {"type": "alias", "string_to_replace": "nginx", "alias": "en gin ex"}])   # replaces the rule of its string
    assert added.version_rules_num == 3 and added.version_id != created.version_id
    removed = client.pronunciation_dictionaries.rules.remove(created.id, rule_strings=["NGINX", "TTS"])
    assert [(r.string_to_replace, r.alias) for r in client.pronunciation_dictionaries.get(created.id).rules] == [
        ("nginx", "en gin ex")] and removed.version_rules_num == 1
    # kept on disk, every kept version: what a restarted server reads back
    reread = PronunciationDictionaries(str(server.voices_dir))
    assert reread.dictionaries == {**reread.dictionaries, created.id: reread.dictionaries[created.id]}
    assert [v.version_id for v in reread.dictionaries[created.id].versions] == [
        created.version_id, added.version_id, removed.version_id]
    assert reread.dictionaries[tts_rules.id].latest.rules[0].alias == "text to speech"


def test_a_locator_speaks_the_replacement_as_if_sent_plainly(server, tts_rules):
    replaced = speech(server, "I like TTS a lot.", **locators(tts_rules))
    assert replaced == speech(server, "I like text to speech a lot.")
    assert replaced != speech(server, "I like TTS a lot.")
    # the batch route takes the field as a default of its items
    status, _, body = request(server.url + "/v1/audio/speech/batch", dict(
        GREEDY, response_format="pcm", items=[{"input": "I like TTS a lot."}], **locators(tts_rules)))
    assert status == 200 and base64.b64decode(json.loads(body)["results"][0]["audio_data"]) == replaced


def test_elevenlabs_clients_send_their_locators_and_get_the_same_audio(server, client, tts_rules):
    """The SDK's convert with pronunciation_dictionary_locators: the audio of /v1/audio/speech with the same
    locator; an id the server never made is ElevenLabs' 400."""
    audio = b"".join(client.text_to_speech.convert(
        "vivian", text="I like TTS a lot.", output_format="pcm_24000", request_options={"additional_body_parameters": {
            k: v for k, v in GREEDY.items() if k in ("temperature", "max_new_tokens", "non_streaming_mode")}},
        pronunciation_dictionary_locators=[{"pronunciation_dictionary_id": tts_rules.id}]))
    assert audio == speech(server, "I like TTS a lot.", **locators(tts_rules))
    status, _, body = request(server.url + "/v1/text-to-speech/vivian", {
        "text": "I like TTS.", "pronunciation_dictionary_locators": [{"pronunciation_dictionary_id": "nope"}]})
    assert status == 400 and "nope" in json.loads(body)["detail"]["message"]


def test_the_servers_and_the_voices_dictionaries_from_the_command_line(server):
    assert speech(server, "We serve Qwen here.") == speech(server, "We serve chwen here.")
    ryan = {"voice": "ryan"}
    assert speech(server, "Hello Bob.", **ryan) == speech(server, "Hello Robert.", **ryan)


@pytest.mark.asyncio
async def test_a_rule_spanning_two_websocket_pieces_applies(server, tts_rules):
    config = {"type": "session.config", **GREEDY, **locators(tts_rules)}
    pieces = [{"type": "input.text", "text": text} for text in ("I like T", "TS a lot.")]
    audio, events = await ws_utterance(server.url, [config, *pieces, {"type": "input.done"}])
    assert events[-1]["type"] == "session.done", events
    assert audio == speech(server, "I like text to speech a lot.")


def test_versions_and_dictionaries_are_bounded():
    store = PronunciationDictionaries(None)   # in memory, as without --voices-dir
    first = store.create("d", None, [AliasRule("a", "b")])
    for n in range(MAX_VERSIONS):
        latest = store.change(first.id, [AliasRule("a", f"v{n}")])
    assert len(latest.versions) == MAX_VERSIONS and first.latest not in latest.versions
    with pytest.raises(ApiError) as dropped:
        store.lexicon_for([PronunciationLocator(first.id, first.latest.version_id)], None)
    assert dropped.value.status == 400 and f"keeps its {MAX_VERSIONS} latest" in dropped.value.message
    second = latest.versions[1].version_id   # an older kept version still speaks its own rules
    assert store.lexicon_for([PronunciationLocator(first.id, second)], None).apply("a") == "v1"
    assert len(store.lexicons) == MAX_VERSIONS   # the dropped version's rules are not held
    for _ in range(MAX_DICTIONARIES - 1):
        store.create("more", None, [])
    with pytest.raises(ApiError) as full:
        store.create("one too many", None, [])
    assert full.value.status == 413


BAD_FILES = [  # (file, status, what the message says)
    (pls('<lexeme><grapheme>a</grapheme><alias>&lol;</alias></lexeme>',
         prolog='<!DOCTYPE lexicon [<!ENTITY lol "lol">]>'), 400, "DOCTYPE or entities"),
    (pls('<lexeme><grapheme>a</grapheme><alias>&xxe;</alias></lexeme>',
         prolog='<!DOCTYPE l [<!ENTITY xxe SYSTEM "file:///etc/passwd">]>'), 400, "DOCTYPE or entities"),
    (pls('<lexeme><grapheme>a</grapheme><alias>b</alias>'), 400, "not well-formed XML"),
    (pls('<lexeme><grapheme>tomato</grapheme><phoneme>təˈmeɪtoʊ</phoneme></lexeme>'), 400,
     "lexeme 1 ('tomato'): phoneme rules"),
    (pls('<lexeme><alias>b</alias></lexeme>'), 400, "lexeme 1 has no <grapheme>"),
    (b"<lexicon>" + b" " * MAX_FILE_BYTES + b"</lexicon>", 413, "larger than"),
]


def test_bad_dictionaries_are_refused_in_elevenlabs_shape(server, client):
    for data, status, message in BAD_FILES:
        with pytest.raises(ElevenLabsError) as refused:
            client.pronunciation_dictionaries.create_from_file(name="bad", file=data)
        assert refused.value.status_code == status and message in refused.value.body["detail"]["message"], \
            refused.value.body
    with pytest.raises(ElevenLabsError) as refused:
        client.pronunciation_dictionaries.create_from_rules(name="ipa", rules=[
            {"type": "alias", "string_to_replace": "a", "alias": "b"},
            {"type": "phoneme", "string_to_replace": "tomato", "phoneme": "təˈmeɪtoʊ", "alphabet": "ipa"}])
    assert refused.value.status_code == 400 and refused.value.body["detail"]["message"].startswith(
        "rules[1] ('tomato'): phoneme rules")
    for found, message in [([{"pronunciation_dictionary_id": "nothing"}], "'nothing' does not exist"),
                           ([{"pronunciation_dictionary_id": "x"}] * 4, "length <= 3")]:
        status, _, body = request(server.url + "/v1/audio/speech", dict(
            GREEDY, input="Hi.", pronunciation_dictionary_locators=found))
        error = json.loads(body)["error"]
        assert status == 400 and message in error["message"] and "pronunciation_dictionary_locators" in (
            error["param"] or error["message"]), error


def test_a_bad_dictionary_file_stops_the_start_with_one_line(tmp_path):
    (tmp_path / "ipa.pls").write_bytes(pls('<lexeme><grapheme>tomato</grapheme><phoneme>x</phoneme></lexeme>'))
    done = subprocess.run([sys.executable, "-m", "omni_tts.entrypoints.cli", "serve", "--model",
                           str(FIXTURES / "tiny-custom-voice"), "--port", str(free_port()),
                           "--pronunciation-dictionary", str(tmp_path / "ipa.pls")],
                          capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert errors == [f"omni-tts serve: error: --pronunciation-dictionary {tmp_path / 'ipa.pls'}: lexeme 1 "
                      "('tomato'): phoneme rules (IPA, X-SAMPA, Arpabet) mean nothing to Qwen3-TTS, which reads "
                      "text: give it an alias (what to say instead)"], done.stderr
