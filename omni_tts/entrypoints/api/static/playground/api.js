// The server's API as the page calls it: relative URLs (the page is served at the server's root, so they stay
// right behind a proxy that moves it), and the API key the user gave, if the server wants one.

// sessionStorage: the key lives as long as the tab, never on disk beyond it, never shared with other tabs
const KEY_STORAGE = "omni_tts.api_key";
// what the server answers when the key comes as a WebSocket subprotocol (api/auth.py, presented_api_key)
const WS_PROTOCOL = "omni-tts";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

function authorization() {
  const key = apiKey();
  return key ? {Authorization: "Bearer " + key} : {};
}

// The error body's message (OpenAI's envelope, ElevenLabs' detail), or the status line when it has none.
async function errorOf(response) {
  let message = `HTTP ${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
    else if (body && body.detail && body.detail.message) message = body.detail.message;
  } catch {
    // not JSON: the status line says it
  }
  return new ApiError(response.status, message);
}

// fetch() with the key; a response that is not 2xx becomes an ApiError with the server's message.
export async function apiFetch(path, init = {}) {
  const response = await fetch(path, {...init, headers: {...authorization(), ...(init.headers || {})}});
  if (!response.ok) throw await errorOf(response);
  return response;
}

export async function getJson(path) {
  return (await apiFetch(path)).json();
}

// A WebSocket to `path` on this server. A browser cannot set headers on it, so the key goes as a subprotocol:
// its UTF-8 in base64url without padding (subprotocol names allow no '+', '/' or '=').
export function webSocketUrl(path) {
  const url = new URL(path, location.href);
  url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
  return url;
}

export function openWebSocket(path) {
  const url = webSocketUrl(path);
  const key = apiKey();
  if (!key) return new WebSocket(url);
  const bytes = new TextEncoder().encode(key);
  const base64url = btoa(String.fromCharCode(...bytes)).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
  return new WebSocket(url, [WS_PROTOCOL, `${WS_PROTOCOL}.bearer.${base64url}`]);
}
