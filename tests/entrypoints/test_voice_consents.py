"""Consent recordings (OpenAI's /v1/audio/voice_consents) kept beside the uploaded voices, and the voices that name
them: the store's bounds, and the routes through the official `openai` SDK against the shared Base server."""
import io
import json
import os

import openai
import pytest
from openai.types.audio import Voice, VoiceConsent

from audio_util import assert_same_audio, encode, tone
from conftest import FIXTURES
from server_util import request
from omni_tts.voices.backend import VoiceError
from omni_tts.voices.consents import SUBDIRECTORY, ConsentStore, is_consent_id

CLIP = (FIXTURES / "ref_voice.wav").read_bytes()


# --- the store ---------------------------------------------------------------------------------------------------
def test_a_recording_is_kept_as_uploaded_renamed_and_deleted(tmp_path):
    store = ConsentStore(str(tmp_path))
    record = store.add("Jane's consent", "en-US", CLIP)
    assert is_consent_id(record.id) and record.file == record.id + ".wav" and record.mime_type == "audio/wav"
    assert (tmp_path / SUBDIRECTORY / record.file).read_bytes() == CLIP
    again = ConsentStore(str(tmp_path))   # another replica, or a restart
    assert again.get(record.id) == record and again.list() == [record]
    renamed = again.rename(record.id, "Jane")
    assert store.get(record.id) == renamed and renamed.name == "Jane" and renamed.created_at == record.created_at
    assert store.delete(record.id) == renamed
    assert store.get(record.id) is None and again.list() == []
    assert sorted(os.listdir(tmp_path / SUBDIRECTORY)) == [".lock"]
    assert store.rename(record.id, "x") is None and store.delete(record.id) is None
    assert store.get("../voices") is None and store.get("cons_" + "0" * 32) is None


def test_recordings_list_in_the_order_they_were_made(tmp_path):
    store = ConsentStore(str(tmp_path))
    made = [store.add(name, "en", CLIP).id for name in "abcdef"]   # within a second: created_at ties
    assert [r.id for r in store.list()] == made


def test_the_store_bounds_count_size_and_quota(tmp_path):
    store = ConsentStore(str(tmp_path), max_consents=2, max_bytes=len(CLIP), quota_bytes=2 * len(CLIP) - 1)
    store.add("a", "en", CLIP)
    with pytest.raises(VoiceError, match="quota") as full:
        store.add("b", "en", CLIP)
    assert (full.value.status, full.value.param) == (413, "recording")
    with pytest.raises(VoiceError, match="larger than") as large:
        store.add("b", "en", CLIP + b"\0")
    assert (large.value.status, large.value.param) == (413, "recording")
    small = encode(tone(1.5), 24000, "WAV")
    store.add("b", "en", small)
    with pytest.raises(VoiceError, match="limit reached") as limit:
        store.add("c", "en", small)
    assert limit.value.status == 409


@pytest.mark.parametrize("name, language, recording, param", [
    (" ", "en", CLIP, "name"), ("a", "english please", CLIP, "language"), ("a", "en", b"", "recording"),
    ("a", "en", b"RIFF" + b"x" * 100, "recording"), ("a", "en", encode(tone(0.5), 24000, "WAV"), "recording"),
])
def test_bad_uploads_are_refused_naming_the_field(tmp_path, name, language, recording, param):
    with pytest.raises(VoiceError) as refused:
        ConsentStore(str(tmp_path)).add(name, language, recording)
    assert refused.value.param == param and refused.value.status == 400


def test_a_corrupt_record_is_skipped(tmp_path):
    store = ConsentStore(str(tmp_path))
    kept = store.add("a", "en", CLIP)
    (tmp_path / SUBDIRECTORY / f"cons_{'1' * 32}.json").write_text("{not json")
    assert store.list() == [kept]


# --- the routes, through the SDK -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client(base_server):
    return openai.OpenAI(base_url=base_server.url + "/v1", api_key="unused", max_retries=0)


def test_consent_crud_through_the_sdk(client):
    created = client.audio.voice_consents.create(name="Speaker A", language="en-US", recording=io.BytesIO(CLIP))
    assert isinstance(created, VoiceConsent) and created.object == "audio.voice_consent"
    assert (created.name, created.language) == ("Speaker A", "en-US") and is_consent_id(created.id)
    assert client.audio.voice_consents.retrieve(created.id) == created
    second = client.audio.voice_consents.create(name="Speaker B", language="de", recording=io.BytesIO(CLIP))
    listed = [c.id for c in client.audio.voice_consents.list(limit=1)]   # the SDK follows the pages
    assert listed.index(created.id) < listed.index(second.id)
    page = client.audio.voice_consents.list(limit=1, after=created.id)
    assert [c.id for c in page.data] == [second.id] and page.has_more is (second.id != listed[-1])
    assert client.audio.voice_consents.update(created.id, name="Speaker A2").name == "Speaker A2"
    assert client.audio.voice_consents.retrieve(created.id).name == "Speaker A2"
    deleted = client.audio.voice_consents.delete(created.id)
    assert (deleted.id, deleted.deleted) == (created.id, True)
    # a page after a recording deleted meanwhile goes on from where it was
    assert client.audio.voice_consents.list(limit=1, after=created.id).data[0].id == second.id
    for call in (lambda: client.audio.voice_consents.retrieve(created.id),
                 lambda: client.audio.voice_consents.delete(created.id),
                 lambda: client.audio.voice_consents.update(created.id, name="x")):
        with pytest.raises(openai.NotFoundError):
            call()
    client.audio.voice_consents.delete(second.id)


@pytest.mark.parametrize("query, param", [("limit=0", "limit"), ("limit=101", "limit"), ("limit=x", "limit"),
                                          ("after=cons_nope", "after"), ("after=..%2Fx", "after")])
def test_list_parameters_are_checked(base_server, query, param):
    status, _, data = request(f"{base_server.url}/v1/audio/voice_consents?{query}")
    assert status == 400 and json.loads(data)["error"]["param"] == param


def test_a_voice_names_its_consent_recording(client, base_server):
    consent = client.audio.voice_consents.create(name="Owner", language="en", recording=io.BytesIO(CLIP))
    voice = client.audio.voices.create(name="consented", audio_sample=io.BytesIO(CLIP), consent=consent.id)
    assert isinstance(voice, Voice) and voice.type == "audio_sample"
    listing = json.loads(request(base_server.url + "/v1/audio/voices")[2])
    assert next(v for v in listing["data"] if v["id"] == "consented")["consent"] == consent.id
    # it speaks, by name and by id
    body = {"model": "tts-1", "input": "Hi.", "response_format": "pcm", "temperature": 0, "max_new_tokens": 8}
    by_id = client.audio.speech.create(voice={"id": "consented"}, **{k: body[k] for k in ("model", "input")},
                                       response_format="pcm", extra_body={"temperature": 0, "max_new_tokens": 8})
    assert len(by_id.content) > 0
    assert_same_audio(by_id.content, request(base_server.url + "/v1/audio/speech", body | {"voice": "consented"})[2])
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.voices.create(name="unconsented", audio_sample=io.BytesIO(CLIP), consent="cons_" + "f" * 32)
    assert refused.value.body["param"] == "consent" and "does not exist" in refused.value.body["message"]
    assert "unconsented" not in {v["id"] for v in json.loads(request(base_server.url + "/v1/audio/voices")[2])["data"]}
    client.audio.voices.delete("consented")
    client.audio.voice_consents.delete(consent.id)
