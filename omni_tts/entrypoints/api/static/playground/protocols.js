// "Speak text" through each API the server speaks, the way that API's own clients call it: every one delivers
// 24 kHz 16-bit mono PCM to on.audio(bytes) as it streams and resolves once the audio is whole. `signal` aborts.
// options: the page's speech fields (model, voice, language, instructions, sampling); a foreign API carries only
// the fields it has (the sampling controls are omni_tts's own).

import {ApiError, apiFetch, apiKey, openWebSocket, webSocketUrl} from "./api.js";

export const PROTOCOLS = {
  speech: "omni_tts: POST /v1/audio/speech (HTTP stream)",
  elevenlabs: "ElevenLabs: POST /v1/text-to-speech/{voice}/stream",
  qwen_realtime: "Qwen-TTS Realtime: WebSocket /api-ws/v1/realtime",
  openai_realtime: "OpenAI Realtime: WebSocket /v1/realtime",
};

export async function speak(protocol, text, options, on, signal) {
  const speakers = {speech: speakSpeech, elevenlabs: speakElevenLabs, qwen_realtime: speakQwenRealtime,
                    openai_realtime: speakOpenAIRealtime};
  return speakers[protocol](text, options, on, signal);
}

async function readAll(response, on) {
  const reader = response.body.getReader();
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    on.audio(value);
  }
}

async function speakSpeech(text, options, on, signal) {
  const response = await apiFetch("v1/audio/speech", {
    method: "POST", headers: {"Content-Type": "application/json"}, signal,
    body: JSON.stringify({...options, input: text, response_format: "pcm", stream: true, stream_format: "audio"}),
  });
  await readAll(response, on);
}

async function speakElevenLabs(text, options, on, signal) {
  const body = {text, model_id: "eleven_multilingual_v2"};
  if (options.language) body.language_code = options.language;
  if (options.seed !== undefined) body.seed = options.seed;
  // omni_tts's own fields ride in the body beside ElevenLabs' (the sampling controls, instructions)
  for (const field of ["temperature", "max_new_tokens", "instructions"]) {
    if (options[field] !== undefined) body[field] = options[field];
  }
  const voice = encodeURIComponent(options.voice || "default");
  const response = await apiFetch(`v1/text-to-speech/${voice}/stream?output_format=pcm_24000`, {
    method: "POST", headers: {"Content-Type": "application/json"}, signal, body: JSON.stringify(body),
  });
  await readAll(response, on);
}

function base64Bytes(text) {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

// One WebSocket conversation: `start(ws)` once open; `receive(event)` returns true once the audio is whole; an
// `error` event or a close before that rejects.
function converse(socket, start, receive, signal) {
  return new Promise((resolve, reject) => {
    let over = false;
    const end = (error) => {
      if (over) return;
      over = true;
      socket.close();
      if (error) reject(error);
      else resolve();
    };
    signal.addEventListener("abort", () => end());
    socket.onopen = () => start(socket);
    socket.onmessage = (message) => {
      const event = JSON.parse(message.data);
      if (event.type === "error") end(new ApiError(400, event.error ? event.error.message : event.message));
      else if (receive(event)) end();
    };
    socket.onclose = () => end(new ApiError(0, "the WebSocket closed before the audio was whole"));
  });
}

async function speakQwenRealtime(text, options, on, signal) {
  const socket = openWebSocket("api-ws/v1/realtime?model=qwen3-tts-flash-realtime");
  const session = {mode: "commit", response_format: "pcm", sample_rate: 24000};
  // the SDK passes extra keyword arguments into the session: omni_tts takes its sampling fields there
  for (const field of ["temperature", "seed", "max_new_tokens"]) {
    if (options[field] !== undefined) session[field] = options[field];
  }
  if (options.voice) session.voice = options.voice;
  if (options.language) session.language_type = options.language;
  if (options.instructions) session.instructions = options.instructions;
  const send = (ws, event) => ws.send(JSON.stringify(event));
  await converse(socket, (ws) => {
    send(ws, {type: "session.update", session});
    send(ws, {type: "input_text_buffer.append", text});
    send(ws, {type: "input_text_buffer.commit"});
    send(ws, {type: "session.finish"});
  }, (event) => {
    if (event.type === "response.audio.delta") on.audio(base64Bytes(event.delta));
    return event.type === "session.finished";
  }, signal);
}

async function speakOpenAIRealtime(text, options, on, signal) {
  // OpenAI's browser clients: the key as the subprotocol `openai-insecure-api-key.<key>` beside `realtime`
  const key = apiKey();
  const socket = new WebSocket(webSocketUrl("v1/realtime?model=gpt-realtime-2.1-mini"),
                               key ? ["realtime", `openai-insecure-api-key.${key}`] : ["realtime"]);
  const output = {format: {type: "audio/pcm", rate: 24000}};
  if (options.voice) output.voice = options.voice;
  const session = {type: "realtime", output_modalities: ["audio"], audio: {output}};
  if (options.instructions) session.instructions = options.instructions;
  if (options.max_new_tokens !== undefined) session.max_output_tokens = options.max_new_tokens;
  if (options.temperature !== undefined) session.temperature = options.temperature;   // omni_tts's extension
  const send = (ws, event) => ws.send(JSON.stringify(event));
  await converse(socket, (ws) => {
    send(ws, {type: "session.update", session});
    send(ws, {type: "response.create", response: {
      conversation: "none", output_modalities: ["audio"],
      input: [{type: "message", role: "user", content: [{type: "input_text", text}]}]}});
  }, (event) => {
    if (event.type === "response.output_audio.delta") on.audio(base64Bytes(event.delta));
    return event.type === "response.done";
  }, signal);
}
