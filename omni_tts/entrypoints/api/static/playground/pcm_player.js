// Plays raw PCM (24 kHz, 16-bit signed little-endian, mono) as it arrives: each piece becomes an AudioBuffer
// played by its own AudioBufferSourceNode, started where the previous one ends, so playback begins with the first
// piece and has no gaps while the pieces come faster than real time.

export const SAMPLE_RATE = 24000;
// scheduling ahead of the audio clock: a piece started "now" would lose its first milliseconds
const START_LEAD_SECONDS = 0.05;

export class PcmPlayer {
  constructor() {
    this.context = null;
    this.nextStart = 0;           // audio-clock time where the next piece starts
    this.takes = [];              // takes not all scheduled yet, oldest first (see release)
    this.unfinished = new Set();  // takes not drained yet: what stop() silences
    this.sources = new Set();     // sources not ended yet
  }

  // The AudioContext, made on first use (browsers let a page make sound only after a user gesture, or with
  // an autoplay policy that allows it). At 24 kHz when the browser allows it: no resampling per piece.
  audioContext() {
    if (!this.context) {
      try {
        this.context = new AudioContext({sampleRate: SAMPLE_RATE, latencyHint: "interactive"});
      } catch {
        this.context = new AudioContext();
      }
    }
    if (this.context.state === "suspended") this.context.resume();
    return this.context;
  }

  // A new take (a request or an utterance) with its own counters and waveform; it plays after the takes begun
  // before it.
  begin() {
    this.audioContext();
    const take = {
      receivedSamples: 0, playedSamples: 0,
      oddByte: null,   // a sample's first byte, when a piece ended between a sample's two bytes
      held: [],        // pieces waiting for the takes before this one (release)
      segments: [],    // {start, length}: where each scheduled piece lies on the audio clock
      samples: [],     // Float32Array pieces, for the waveform
      sources: new Set(),
      ended: false, stopped: false,
    };
    take.drained = new Promise((resolve) => { take.resolveDrained = resolve; });
    this.takes.push(take);
    this.unfinished.add(take);
    return take;
  }

  // One piece of the take's byte stream, cut anywhere (a sample's two bytes may arrive in two pieces).
  push(take, bytes) {
    if (take.oddByte !== null) {
      const joined = new Uint8Array(bytes.length + 1);
      joined[0] = take.oddByte;
      joined.set(bytes, 1);
      bytes = joined;
      take.oddByte = null;
    }
    const count = bytes.length >> 1;
    if (bytes.length & 1) take.oddByte = bytes[bytes.length - 1];
    if (count === 0 || take.stopped) return;
    // DataView: the wire is little-endian whatever the machine's byte order
    const view = new DataView(bytes.buffer, bytes.byteOffset, count * 2);
    const samples = new Float32Array(count);
    for (let i = 0; i < count; i++) samples[i] = view.getInt16(2 * i, true) / 32768;
    take.receivedSamples += count;
    take.samples.push(samples);
    take.held.push(samples);
    this.release();
  }

  // No more pieces for the take; take.drained resolves once all of it has played (or was stopped).
  end(take) {
    take.ended = true;
    this.release();
    this.settle(take);
  }

  // Takes play one after another, whole: the oldest schedules its pieces as they come, and a later take (an
  // utterance typed while the last one still speaks) holds its pieces until every take before it has ended.
  release() {
    while (this.takes.length) {
      const take = this.takes[0];
      for (const samples of take.held) this.schedule(take, samples);
      take.held = [];
      if (!take.ended) return;
      this.takes.shift();
    }
  }

  schedule(take, samples) {
    const context = this.context;
    const buffer = context.createBuffer(1, samples.length, SAMPLE_RATE);
    buffer.copyToChannel(samples, 0);
    const source = context.createBufferSource();
    source.buffer = buffer;
    source.connect(context.destination);
    // behind the clock (the first piece, or the stream ran dry): start just ahead of it
    const start = Math.max(this.nextStart, context.currentTime + START_LEAD_SECONDS);
    source.start(start);
    this.nextStart = start + samples.length / SAMPLE_RATE;
    take.segments.push({start, length: samples.length});
    take.sources.add(source);
    this.sources.add(source);
    source.onended = () => {
      take.sources.delete(source);
      this.sources.delete(source);
      if (!take.stopped) take.playedSamples += samples.length;
      this.settle(take);
    };
  }

  settle(take) {
    if (take.ended && take.held.length === 0 && take.sources.size === 0) {
      this.unfinished.delete(take);
      take.resolveDrained();
    }
  }

  // Silence now: every take stops, counting what it played until then.
  stop() {
    for (const take of this.unfinished) {
      take.playedSamples = this.playedNow(take);
      take.stopped = take.ended = true;
      take.held = [];
      this.settle(take);
    }
    this.takes = [];
    for (const source of this.sources) source.stop();  // their onended settles their takes
    this.nextStart = 0;
  }

  // Samples of the take played by now on the audio clock (the waveform's play head).
  playedNow(take) {
    const now = this.context.currentTime;
    let played = 0;
    for (const {start, length} of take.segments) {
      played += Math.min(length, Math.max(0, Math.round((now - start) * SAMPLE_RATE)));
    }
    return played;
  }
}
