// One typed utterance over WS /v1/audio/speech/stream: a session of its own, opened at the first keystroke and
// closed after the server's session.done, so no idle session is held open between utterances. Token mode: the
// server speaks the utterance as one request whose text grows while the user types.

import {openWebSocket} from "./api.js";

export class TypedUtterance {
  // options: the speech fields (model, voice, ...); on: {audio(bytes), done(), error(message)}
  constructor(options, on) {
    this.on = on;
    this.finished = false;   // session.done or an error arrived: a close after it is expected
    this.outbox = [];        // messages sent before the socket opened
    this.send({type: "session.config", ...options, split_granularity: "token", stream_audio: true,
               response_format: "pcm"});
    this.ws = openWebSocket("v1/audio/speech/stream");
    this.ws.binaryType = "arraybuffer";
    this.ws.onopen = () => {
      for (const message of this.outbox) this.ws.send(message);
      this.outbox = [];
    };
    this.ws.onmessage = (event) => this.receive(event.data);
    this.ws.onclose = (event) => {
      if (this.finished) return;
      this.finished = true;
      // a refused handshake (a wrong key, a full server) reaches the page only as a close without a reason
      this.on.error(event.reason || "the WebSocket closed before the utterance was spoken (is the API key right?)");
    };
  }

  send(message) {
    const data = JSON.stringify(message);
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(data);
    else this.outbox.push(data);
  }

  addText(text) {
    this.send({type: "input.text", text});
  }

  finish() {
    this.send({type: "input.done"});
  }

  receive(data) {
    if (typeof data !== "string") {
      this.on.audio(new Uint8Array(data));
      return;
    }
    const event = JSON.parse(data);
    if (event.type === "session.done") {
      this.finished = true;
      this.send({type: "session.close"});
      this.on.done();
    } else if (event.type === "error") {
      this.finished = true;
      this.on.error(event.message);
    }
  }

  close() {
    this.finished = true;
    this.ws.close();
  }
}
