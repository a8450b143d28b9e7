// The waveform of a take on a canvas: what arrived in grey, what has played in colour.

import {SAMPLE_RATE} from "./pcm_player.js";

const BLOCK_SAMPLES = 120;  // one peak (min, max) per 5 ms: a minute of audio is 12,000 peaks
const MIN_AXIS_SECONDS = 4; // the axis spans at least this, so a short take does not stretch across the canvas

export class Waveform {
  constructor(canvas) {
    this.canvas = canvas;
    this.take = null;
  }

  // Peaks of the take's pieces not read yet; the last block stays open until it is full.
  readPeaks(take) {
    if (this.take !== take) {
      this.take = take;
      this.piecesRead = 0;
      this.mins = [];
      this.maxs = [];
      this.blockFill = 0;
    }
    for (; this.piecesRead < take.samples.length; this.piecesRead++) {
      for (const value of take.samples[this.piecesRead]) {
        if (this.blockFill === 0) {
          this.mins.push(value);
          this.maxs.push(value);
        }
        const last = this.mins.length - 1;
        if (value < this.mins[last]) this.mins[last] = value;
        if (value > this.maxs[last]) this.maxs[last] = value;
        this.blockFill = (this.blockFill + 1) % BLOCK_SAMPLES;
      }
    }
  }

  draw(take, playedSamples) {
    const canvas = this.canvas;
    const width = Math.max(1, Math.round(canvas.clientWidth * devicePixelRatio));
    const height = Math.max(1, Math.round(canvas.clientHeight * devicePixelRatio));
    if (canvas.width !== width || canvas.height !== height) {
      canvas.width = width;
      canvas.height = height;
    }
    const g = canvas.getContext("2d");
    g.clearRect(0, 0, width, height);
    if (!take) return;
    this.readPeaks(take);
    const axisBlocks = Math.max(this.mins.length, (MIN_AXIS_SECONDS * SAMPLE_RATE) / BLOCK_SAMPLES);
    const playedBlocks = playedSamples / BLOCK_SAMPLES;
    const middle = height / 2;
    for (let x = 0; x < width; x++) {
      const first = Math.floor((x * axisBlocks) / width);
      const last = Math.min(this.mins.length, Math.max(first + 1, Math.floor(((x + 1) * axisBlocks) / width)));
      if (first >= this.mins.length) break;
      let low = 1, high = -1;
      for (let b = first; b < last; b++) {
        low = Math.min(low, this.mins[b]);
        high = Math.max(high, this.maxs[b]);
      }
      g.fillStyle = first < playedBlocks ? "#0b6bcb" : "#b8bec7";
      // at least one pixel tall, so silence still shows where the audio is
      g.fillRect(x, middle - high * middle, 1, Math.max(1, (high - low) * middle));
    }
  }
}
