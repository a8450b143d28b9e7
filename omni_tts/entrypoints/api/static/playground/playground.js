// The playground page: controls filled from the server's API, speech played as it streams, and the time to the
// first audio (TTFP) and real-time factor (RTF) of each take. The figures are also data attributes of #stats, for
// tests (tests/entrypoints/test_playground.py) and anyone scripting the page.

import {ApiError, apiFetch, apiKey, getJson, setApiKey} from "./api.js";
import {PcmPlayer, SAMPLE_RATE} from "./pcm_player.js";
import {PROTOCOLS, speak} from "./protocols.js";
import {TypedUtterance} from "./type_to_speak.js";
import {Waveform} from "./waveform.js";

const $ = (id) => document.getElementById(id);
const TASK_TYPES = ["CustomVoice", "VoiceDesign", "Base"];

const player = new PcmPlayer();
const waveform = new Waveform($("waveform"));
let models = [];          // GET /v1/models: data
let voiceList = null;     // GET /v1/audio/voices
let run = null;           // the take shown in #stats
let speechAbort = null;   // aborts the HTTP request in flight
let utterance = null;     // the TypedUtterance being typed
let typedSent = "";       // the text of it sent so far
const speaking = new Set(); // TypedUtterances not over yet (typed, or ended and still speaking): what Stop closes

// --- errors --------------------------------------------------------------------------------------------------
function showError(message) {
  $("error").textContent = message;
}

function describe(error) {
  return error instanceof ApiError ? error.message : String(error);
}

// --- one measured take: an HTTP request or a typed utterance ----------------------------------------------------
class Run {
  constructor(mode, take) {
    this.mode = mode;
    this.take = take;
    this.sentAt = performance.now();   // the request, or the utterance's first text, left
    this.firstAudioAt = null;
    this.finishedAt = null;            // the last audio arrived
    this.state = "requesting";
  }

  get over() {
    return this.state === "stopped" || this.state === "error";
  }

  audio(bytes) {
    if (this.over) return;  // what was still on its way
    if (this.firstAudioAt === null && bytes.length) {
      this.firstAudioAt = performance.now();
      this.state = "streaming";
    }
    player.push(this.take, bytes);
  }

  // The last audio arrived: played out, the take is done.
  async finish() {
    if (this.over) return;
    this.finishedAt = performance.now();
    this.state = "playing";
    player.end(this.take);
    await this.take.drained;
    if (this.state === "playing") this.state = "done";
    render();
  }

  fail(message) {
    this.state = "error";
    player.stop();
    showError(message);
    render();
  }

  get audioSeconds() {
    return this.take.receivedSamples / SAMPLE_RATE;
  }
}

function startRun(mode) {
  showError("");
  run = new Run(mode, player.begin());
  render();
  requestAnimationFrame(animate);
  return run;
}

// #stats and the waveform from the current run; while it plays, once a frame.
function render() {
  const stats = $("stats");
  if (!run) return;
  const ttfpMs = run.firstAudioAt === null ? null : run.firstAudioAt - run.sentAt;
  const rtf = run.finishedAt === null || !run.audioSeconds ? null
    : (run.finishedAt - run.sentAt) / 1000 / run.audioSeconds;
  Object.assign(stats.dataset, {
    mode: run.mode, state: run.state, ttfpMs: ttfpMs === null ? "" : ttfpMs.toFixed(1),
    rtf: rtf === null ? "" : rtf.toFixed(3), samplesReceived: run.take.receivedSamples,
    samplesPlayed: run.take.playedSamples,
  });
  $("ttfp").textContent = ttfpMs === null ? "–" : `${Math.round(ttfpMs)} ms`;
  $("rtf").textContent = rtf === null ? "–" : rtf.toFixed(2);
  $("audio-seconds").textContent = run.take.receivedSamples ? `${run.audioSeconds.toFixed(2)} s` : "–";
  const playedNow = run.state === "done" ? run.take.playedSamples : player.playedNow(run.take);
  $("played").textContent = `${(playedNow / SAMPLE_RATE).toFixed(2)} s`;
  $("state").textContent = run.state;
  waveform.draw(run.take, playedNow);
}

function animate() {
  render();
  if (run && ["requesting", "streaming", "playing"].includes(run.state)) requestAnimationFrame(animate);
}

// --- the controls ----------------------------------------------------------------------------------------------
function currentModel() {
  return models.find((model) => model.id === $("model").value) || models[0];
}

function option(value, label = value) {
  const element = document.createElement("option");
  element.value = value;
  element.textContent = label;
  return element;
}

function fillSelect(select, values, selected) {
  select.replaceChildren(...values.map((value) => option(value)));
  if (values.includes(selected)) select.value = selected;
}

// The voices the checkpoint takes: its speakers and uploaded voices, and the alias table's names (OpenAI's,
// ElevenLabs' and DashScope's voices) with the voice each stands for. VoiceDesign takes none: the voice is described in the instructions.
function fillVoices(selected) {
  const taskType = currentModel().task_type;
  const select = $("voice");
  select.replaceChildren();
  const names = document.createElement("optgroup");
  names.label = taskType === "Base" ? "Uploaded voices" : "Speakers";
  names.append(...voiceList.voices.map((name) => option(name)));
  if (names.children.length) select.append(names);
  const aliases = Object.entries(voiceList.voice_aliases || {});
  if (aliases.length) {
    const group = document.createElement("optgroup");
    group.label = "Aliases (other APIs' voice names)";
    group.append(...aliases.map(([alias, speaker]) => option(alias, `${alias} → ${speaker}`)));
    select.append(group);
  }
  if (!select.options.length) {
    const none = option("", "none yet: upload one below");
    none.disabled = true;
    select.append(none);
  }
  if (selected && [...select.options].some((o) => o.value === selected)) select.value = selected;
}

function fillForModel() {
  const model = currentModel();
  const taskType = model.task_type;
  fillSelect($("task-type"), TASK_TYPES, taskType);
  // the server takes only the checkpoint's own task: the others are shown, not offered
  for (const element of $("task-type").options) element.disabled = element.value !== taskType;
  fillSelect($("language"), model.languages || ["auto"], $("language").value || "auto");
  fillVoices($("voice").value);
  $("voice-field").hidden = taskType === "VoiceDesign";
  $("instructions-field").hidden = taskType === "Base";
  $("instructions-label").textContent = taskType === "VoiceDesign"
    ? "Voice description (required: who speaks, and how)" : "Instructions (optional: tone, emotion, pace)";
  $("upload-form").hidden = taskType !== "Base";
}

// The fields of a speech request (and of a session.config) the controls set; unset ones are left out.
function speechOptions() {
  const model = currentModel();
  const options = {model: model.id, task_type: model.task_type};
  if (!$("voice-field").hidden && $("voice").value) options.voice = $("voice").value;
  if ($("language").value && $("language").value !== "auto") options.language = $("language").value;
  if (!$("instructions-field").hidden && $("instructions").value.trim()) {
    options.instructions = $("instructions").value;
  }
  for (const [id, field, parse] of [["temperature", "temperature", parseFloat], ["seed", "seed", parseInt],
                                    ["max-new-tokens", "max_new_tokens", parseInt]]) {
    if ($(id).value !== "") options[field] = parse($(id).value);
  }
  return options;
}

// --- speak text: through the API picked (protocols.js), raw PCM played as it streams -----------------------------
async function speakText() {
  stopAll();
  const text = $("text").value;
  if (!text.trim()) return showError("Type some text to speak first.");
  const current = startRun("speak");
  const abort = speechAbort = new AbortController();
  try {
    await speak($("protocol").value, text, speechOptions(), {audio: (bytes) => current.audio(bytes)}, abort.signal);
    await current.finish();
  } catch (error) {
    if (!abort.signal.aborted) current.fail(describe(error));
  }
}

// --- type to speak: WS /v1/audio/speech/stream in token mode -------------------------------------------------------
function startUtterance() {
  const current = startRun("type");
  const typed = new TypedUtterance(speechOptions(), {
    audio: (bytes) => current.audio(bytes),
    done: () => {
      speaking.delete(typed);
      current.finish();
    },
    error: (message) => {
      speaking.delete(typed);
      current.fail(message);
    },
  });
  speaking.add(typed);
  return typed;
}

function onTyped() {
  const value = $("typed").value;
  if (!value.startsWith(typedSent)) {
    // the server already has that text: it cannot be taken back, only added to
    $("typed").value = typedSent;
    $("typed-note").textContent = "Text already sent cannot be changed; Enter ends the utterance.";
    return;
  }
  const added = value.slice(typedSent.length);
  if (!added) return;
  $("typed-note").textContent = "";
  if (!utterance) utterance = startUtterance();
  utterance.addText(added);
  typedSent = value;
}

function endUtterance() {
  if (!utterance) return;
  utterance.finish();
  $("typed-note").textContent = `Speaking: “${typedSent.trim()}”`;
  utterance = null;
  typedSent = "";
  $("typed").value = "";
}

// --- stop, upload, load ----------------------------------------------------------------------------------------
function stopAll() {
  if (speechAbort) speechAbort.abort();
  speechAbort = null;
  for (const typed of speaking) typed.close();
  speaking.clear();
  utterance = null;
  typedSent = "";
  player.stop();
  if (run && ["requesting", "streaming", "playing"].includes(run.state)) {
    run.state = "stopped";
    render();
  }
}

async function uploadVoice(event) {
  event.preventDefault();
  const form = new FormData();
  const name = $("upload-name").value.trim();
  form.append("name", name);
  form.append("audio_sample", $("upload-audio").files[0]);
  if ($("upload-ref-text").value.trim()) form.append("ref_text", $("upload-ref-text").value.trim());
  $("upload-status").textContent = "uploading…";
  try {
    const voice = await (await apiFetch("v1/audio/voices", {method: "POST", body: form})).json();
    voiceList = await getJson("v1/audio/voices");
    fillVoices(voice.id);
    $("upload-status").textContent = `uploaded ${voice.id} (${voice.duration_s.toFixed(1)} s)`;
  } catch (error) {
    $("upload-status").textContent = "";
    showError(describe(error));
  }
}

async function load() {
  showError("");
  try {
    models = (await getJson("v1/models")).data;
    voiceList = await getJson("v1/audio/voices");
  } catch (error) {
    if (error instanceof ApiError && error.status === 401) {
      $("key-form").hidden = false;
      $("controls").hidden = true;
      if (apiKey()) showError("That key was refused.");
      return;
    }
    throw error;
  }
  $("key-form").hidden = true;
  $("controls").hidden = false;
  $("random-weights").hidden = !models.some((model) => model.random_weights);
  fillSelect($("model"), models.map((model) => model.id), $("model").value);
  fillForModel();
  document.body.dataset.loaded = "true";  // tests wait for this
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  setApiKey($("key").value);
  load().catch((error) => showError(describe(error)));
});
$("protocol").replaceChildren(...Object.entries(PROTOCOLS).map(([value, label]) => option(value, label)));
$("model").addEventListener("change", fillForModel);
$("speak").addEventListener("click", speakText);
$("stop").addEventListener("click", stopAll);
$("typed").addEventListener("input", onTyped);
$("typed").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    endUtterance();
  }
});
$("end-utterance").addEventListener("click", endUtterance);
for (const radio of document.querySelectorAll("input[name=mode]")) {
  radio.addEventListener("change", () => {  // fired by the radio that became checked
    stopAll();
    $("speak-mode").hidden = radio.value !== "speak";
    $("type-mode").hidden = radio.value !== "type";
  });
}
$("upload-form").addEventListener("submit", uploadVoice);
load().catch((error) => showError(describe(error)));
