"""Text that streams in at LLM speed: time to first audio over `WS /v1/audio/speech/stream`, split_granularity
"token" against "sentence" (and "none", the whole utterance after input.done, as a baseline).

    python benchmarks/bench_text_stream.py                                  # the embedded tiny model, 5 sessions/mode
    python benchmarks/bench_text_stream.py --preset medium --out medium.json   # a larger random model (cpu_small)
    python benchmarks/bench_text_stream.py --url http://127.0.0.1:8000 --model-name qwen3-tts --voice ryan

A multi-sentence text is cut where the model's own text tokenizer (Qwen2 BPE) cuts it, one delta per token as an
LLM streams it (a token that ends inside a UTF-8 character is held back and goes with the next, as detokenizers
do), and sent as `input.text` messages at `--rate` tokens/s, then `input.done` right after the last one. The
session asks for `stream_audio: true`, `response_format: "pcm"`, greedy decoding unless --temperature. Per session:

  TTFA   first binary audio frame received - first input.text sent
  tail   last audio frame received - input.done sent
  stall  seconds a player that starts at the first frame would wait for audio (underruns, summed)
  tokens how many deltas had been sent when the first audio arrived

Sessions run one after another, the modes interleaved (a warm-up round first, not counted), so a load change on the
machine hits every mode alike; `--concurrency C` runs C sessions of a mode at once per round instead. The audio of
token mode is checked against one whole-text `POST /v1/audio/speech` (`non_streaming_mode: false`, same sampling):
with temperature 0 it must have the same length (and samples within one int16 step).

Starts `omni-tts serve` itself on a free loopback port (thread variables removed from its environment, as the
other benchmarks) unless --url: `--model DIR`, else `--preset NAME` (the random CustomVoice checkpoint under
$OMNI_TTS_CACHE, built on first use; stage config cpu_small unless tiny), else the embedded tiny model. Prints a
table; `--out FILE` also writes every session's figures, the revision and the machine as JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
import unicodedata

import aiohttp
import numpy as np

from bench_runner import HERE, cached_model, machine, scrub_thread_env  # also puts HERE on sys.path
from bench_tts_serve import Server

SAMPLE_RATE = 24000
PCM_BYTES_PER_SAMPLE = 2
SERVED_NAME = "qwen3-tts"
MODES = ("token", "sentence", "clause", "none")
SESSION_TIMEOUT = 600.0
# an assistant's answer as an LLM would stream it: five sentences, 74 Qwen2 tokens, the first of them 24 tokens long
DEFAULT_TEXT = ("I checked the schedule for you, and the next train to the airport leaves at a quarter past six from "
                "platform four. If you hurry, you can still make it. Otherwise, the one after that arrives just before "
                "seven, which is a little late for dinner. Let me know which one you want, and I will book two seats "
                "by the window. Safe travels!")


# --- the text as an LLM streams it --------------------------------------------------------------------------------
def token_deltas(tokenizer, text: str) -> list[str]:
    """The text cut at its token boundaries: each delta is what decoding one more token adds."""
    ids = tokenizer.encode(text).ids
    deltas, emitted = [], ""
    for n in range(1, len(ids) + 1):
        decoded = tokenizer.decode(ids[:n])
        if decoded.endswith("\ufffd") and n < len(ids):
            continue  # the token ends inside a UTF-8 character: held back, it goes with the next
        if not decoded.startswith(emitted):
            raise SystemExit(f"decoding {n} tokens does not extend the decoding of fewer: {decoded!r}")
        deltas.append(decoded[len(emitted):])
        emitted = decoded
    if emitted != unicodedata.normalize("NFC", text):
        raise SystemExit(f"the deltas do not join to the text: {emitted!r}")
    return deltas


def load_tokenizer(model_dir: str | None):
    """The checkpoint's text tokenizer; the embedded tiny model's (the same Qwen2 vocabulary) without a local one."""
    from omni_tts.models.qwen3_tts.text_tokenizer import load_text_tokenizer
    if model_dir is None or not os.path.isfile(os.path.join(model_dir, "vocab.json")):
        from omni_tts.models.qwen3_tts.random_model import default_model_dir
        model_dir = default_model_dir()
    return load_text_tokenizer(model_dir)


# --- one session --------------------------------------------------------------------------------------------------
def session_config(args: argparse.Namespace, mode: str) -> dict:
    config = {"type": "session.config", "voice": args.voice, "response_format": "pcm", "stream_audio": True,
              "split_granularity": mode, "temperature": args.temperature}
    if args.model_name:
        config["model"] = args.model_name
    if args.max_new_tokens is not None:
        config["max_new_tokens"] = args.max_new_tokens
    return config


def stall_seconds(packets: list[tuple[float, int]]) -> float:
    """Underrun time of a player that starts playing at the first packet and plays every packet as it is due."""
    if not packets:
        return 0.0
    start, played, stalled = packets[0][0], 0.0, 0.0
    for arrival, size in packets:
        due = start + played + stalled
        if arrival > due:
            stalled += arrival - due
        played += size / (SAMPLE_RATE * PCM_BYTES_PER_SAMPLE)
    return stalled


async def one_session(http: aiohttp.ClientSession, args: argparse.Namespace, mode: str,
                      deltas: list[str]) -> tuple[dict, bytes]:
    """One utterance on a connection of its own: its figures and its audio."""
    ws = await http.ws_connect(args.url + "/v1/audio/speech/stream", headers=args.headers, max_msg_size=0)
    sent: list[float] = []
    packets: list[tuple[float, int]] = []
    pcm = bytearray()
    starts: list[dict] = []
    done_event: dict = {}
    try:
        await ws.send_json(session_config(args, mode))

        async def send() -> float:
            begin = time.perf_counter()
            for i, delta in enumerate(deltas):
                delay = begin + i / args.rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                sent.append(time.perf_counter())
                await ws.send_json({"type": "input.text", "text": delta})
            done_at = time.perf_counter()
            await ws.send_json({"type": "input.done"})
            return done_at

        async def receive() -> None:
            async for message in ws:
                if message.type == aiohttp.WSMsgType.BINARY:
                    packets.append((time.perf_counter(), len(message.data)))
                    pcm.extend(message.data)
                    continue
                if message.type != aiohttp.WSMsgType.TEXT:
                    break
                event = json.loads(message.data)
                if event["type"] == "error":
                    raise RuntimeError(f"the server ended the session: {event.get('message')}")
                if event["type"] == "audio.start":
                    starts.append(event)
                elif event["type"] == "session.done":
                    done_event.update(event)
                    return
            raise RuntimeError("the connection closed before session.done")

        sender = asyncio.create_task(send())
        try:
            await asyncio.wait_for(receive(), SESSION_TIMEOUT)
        finally:
            if not sender.done():
                sender.cancel()
            done_at = (await asyncio.gather(sender, return_exceptions=True))[0]
        if isinstance(done_at, BaseException):
            raise done_at
        await ws.send_json({"type": "session.close"})
    finally:
        await ws.close()
    if not packets:
        raise RuntimeError(f"{mode}: no audio")
    first, last = packets[0][0], packets[-1][0]
    return {
        "mode": mode,
        "ttfa_s": first - sent[0],
        "tail_s": last - done_at,
        "e2e_s": last - sent[0],
        "text_s": done_at - sent[0],
        "audio_s": len(pcm) / (SAMPLE_RATE * PCM_BYTES_PER_SAMPLE),
        "stall_s": stall_seconds(packets),
        "tokens_before_audio": sum(t <= first for t in sent),
        "tokens": len(deltas),
        "requests": done_event.get("total_sentences"),
        "first_start_text": starts[0].get("sentence_text") if starts else None,
        "frames": len(packets),
        # each audio frame: [received - first input.text sent, seconds of audio in it]
        "packets": [[round(t - sent[0], 4), size / (SAMPLE_RATE * PCM_BYTES_PER_SAMPLE)] for t, size in packets],
    }, bytes(pcm)


async def whole_text_pcm(http: aiohttp.ClientSession, args: argparse.Namespace) -> bytes:
    """The sanity reference: the whole text in one request, streaming layout, the sessions' sampling."""
    body = {"input": args.text, "voice": args.voice, "response_format": "pcm", "non_streaming_mode": False,
            "temperature": args.temperature}
    if args.model_name:
        body["model"] = args.model_name
    if args.max_new_tokens is not None:
        body["max_new_tokens"] = args.max_new_tokens
    async with http.post(args.url + "/v1/audio/speech", json=body, headers=args.headers) as r:
        data = await r.read()
        if r.status != 200:
            raise SystemExit(f"POST /v1/audio/speech answered {r.status}: {data[:300]!r}")
        return data


# --- the run ------------------------------------------------------------------------------------------------------
async def run(args: argparse.Namespace, deltas: list[str]) -> dict:
    sessions, token_pcms = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
        reference = await whole_text_pcm(http, args)
        rounds = args.warmups + args.sessions
        for round_index in range(rounds):
            warmup = round_index < args.warmups
            for mode in args.modes:
                results = await asyncio.gather(*(one_session(http, args, mode, deltas)
                                                 for _ in range(args.concurrency)))
                for index, (figures, pcm) in enumerate(results):
                    figures |= {"round": round_index, "warmup": warmup, "slot": index,
                                "concurrency": args.concurrency}
                    sessions.append(figures)
                    if mode == "token" and not warmup:
                        token_pcms.append(pcm)
                    if not args.quiet:
                        print(f"{'warm-up' if warmup else f'round {round_index - args.warmups + 1}/{args.sessions}'}"
                              f" {mode:>8}: TTFA {figures['ttfa_s'] * 1000:7.0f} ms after "
                              f"{figures['tokens_before_audio']:3d} tokens, tail {figures['tail_s'] * 1000:7.0f} ms,"
                              f" audio {figures['audio_s']:6.2f} s, stall {figures['stall_s']:5.2f} s",
                              file=sys.stderr, flush=True)
    return {"sessions": sessions, "summary": summarize(sessions, args.modes),
            "sanity": sanity(reference, token_pcms, args.temperature)}


def sanity(reference: bytes, token_pcms: list[bytes], temperature: float) -> dict:
    expected = np.frombuffer(reference, "<i2")
    lengths_equal = [len(p) == len(reference) for p in token_pcms]
    diffs = [int(np.abs(np.frombuffer(p, "<i2").astype(np.int32) - expected).max(initial=0))
             for p, same in zip(token_pcms, lengths_equal) if same]
    doc = {"whole_text_audio_s": len(reference) / (SAMPLE_RATE * PCM_BYTES_PER_SAMPLE),
           "token_sessions": len(token_pcms), "same_length": sum(lengths_equal),
           "max_abs_diff": max(diffs) if diffs else None, "greedy": temperature == 0}
    doc["ok"] = (not doc["greedy"] or not token_pcms
                 or (doc["same_length"] == len(token_pcms) and (doc["max_abs_diff"] or 0) <= 1))
    return doc


def summarize(sessions: list[dict], modes: list[str]) -> dict:
    out = {}
    for mode in modes:
        rows = [s for s in sessions if s["mode"] == mode and not s["warmup"]]
        if not rows:
            continue

        def pct(key: str, q: float) -> float:
            return float(np.percentile([r[key] for r in rows], q))
        out[mode] = {"sessions": len(rows), "ttfa_p50_s": pct("ttfa_s", 50), "ttfa_p90_s": pct("ttfa_s", 90),
                     "tokens_before_audio_p50": pct("tokens_before_audio", 50), "tail_p50_s": pct("tail_s", 50),
                     "tail_p90_s": pct("tail_s", 90), "e2e_p50_s": pct("e2e_s", 50),
                     "audio_s_p50": pct("audio_s", 50), "stall_p50_s": pct("stall_s", 50),
                     "text_s_p50": pct("text_s", 50), "requests": rows[0]["requests"]}
    return out


def table(doc: dict) -> str:
    lines = ["| mode | sessions | TTFA p50 ms | TTFA p90 ms | tokens sent by first audio (p50) | tail p50 ms | "
             "audio s (p50) | stall p50 s | requests |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, s in doc["summary"].items():
        lines.append(f"| {mode} | {s['sessions']} | {s['ttfa_p50_s'] * 1000:.0f} | {s['ttfa_p90_s'] * 1000:.0f} | "
                     f"{s['tokens_before_audio_p50']:.0f} of {doc['tokens']} | {s['tail_p50_s'] * 1000:.0f} | "
                     f"{s['audio_s_p50']:.2f} | {s['stall_p50_s']:.2f} | {s['requests']} |")
    c = doc["sanity"]
    verdict = "ok" if c["ok"] else "MISMATCH"
    lines += ["", f"text: {doc['tokens']} tokens at {doc['config']['rate']:g} tokens/s "
                  f"({doc['tokens'] / doc['config']['rate']:.2f} s); concurrency {doc['config']['concurrency']}",
              f"sanity (token mode vs one whole-text HTTP request, streaming layout): {verdict} — "
              f"{c['same_length']}/{c['token_sessions']} sessions of the same length "
              f"({c['whole_text_audio_s']:.2f} s), max |diff| {c['max_abs_diff']} (int16)"
              + ("" if c["greedy"] else "; sampling, so lengths may differ")]
    return "\n".join(lines)


# --- command line -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("server")
    g.add_argument("--url", help="a running server's base URL (default: start `omni-tts serve` for the run)")
    g.add_argument("--model", help="checkpoint directory to serve (and whose text tokenizer cuts the text)")
    g.add_argument("--preset", help="serve the random CustomVoice checkpoint of this preset (small, medium, ...), "
                                    "built under $OMNI_TTS_CACHE on first use")
    g.add_argument("--stage-config", help="stage config for the started server (default: cpu_small with a --preset "
                                          "other than tiny, else the server's default)")
    g.add_argument("--model-name", help="the `model` sent (default: qwen3-tts for a started server, none with --url)")
    g.add_argument("--api-key", default=os.environ.get("OMNI_TTS_API_KEY"))
    g.add_argument("--server-log", help="the started server's log (default: a temporary file)")
    g = ap.add_argument_group("sessions")
    g.add_argument("--modes", nargs="+", choices=MODES, default=["token", "sentence", "none"])
    g.add_argument("--sessions", type=int, default=5, help="timed rounds; each runs every mode once (default 5)")
    g.add_argument("--warmups", type=int, default=1, help="untimed rounds first (default 1)")
    g.add_argument("--concurrency", type=int, default=1, help="sessions of a mode at once per round (default 1)")
    g.add_argument("--rate", type=float, default=30.0, help="text tokens per second (default 30)")
    g.add_argument("--text", default=DEFAULT_TEXT)
    g.add_argument("--voice", default="ryan")
    g.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    g.add_argument("--max-new-tokens", type=int, help="codec frames per request at most (default: the server's)")
    ap.add_argument("--out", help="write the run as JSON here")
    ap.add_argument("--quiet", action="store_true", help="no line per session on stderr")
    args = ap.parse_args(argv)
    if args.url and (args.preset or args.stage_config):
        ap.error("--preset and --stage-config are for a started server, not --url")
    if args.model and args.preset:
        ap.error("give --model or --preset, not both")
    if min(args.sessions, args.concurrency) < 1 or args.warmups < 0 or args.rate <= 0:
        ap.error("--sessions and --concurrency must be ≥ 1, --warmups ≥ 0, --rate > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    server = None
    if args.url is None:
        scrub_thread_env()
        if args.preset:
            args.model = cached_model(args.preset)
        elif args.model is None:
            from omni_tts.models.qwen3_tts.random_model import default_model_dir
            args.model = default_model_dir()
        if args.stage_config is None and args.preset not in (None, "tiny"):
            args.stage_config = "cpu_small"
        args.model_name = args.model_name or SERVED_NAME
        serve = ["--model", args.model, "--served-model-name", SERVED_NAME, "--max-queue", "1024"]
        serve += ["--stage-config", args.stage_config] if args.stage_config else []
        if args.api_key:
            serve += ["--api-key", args.api_key]
        log_path = args.server_log or os.path.join(tempfile.mkdtemp(prefix="bench_text_stream-"), "server.log")
        server = Server(shlex.join(serve), log_path, 600)
        print(f"starting {shlex.join(server.cmd)} (log: {log_path})", file=sys.stderr)
    deltas = token_deltas(load_tokenizer(args.model), args.text)
    try:
        if server is not None:
            asyncio.run(server.wait_healthy())
            args.url = server.url
        started = time.time()
        result = asyncio.run(run(args, deltas))
    finally:
        if server is not None:
            server.stop()
    config = {k: v for k, v in vars(args).items() if k not in ("headers", "api_key")}
    doc = {"kind": "bench_text_stream", "version": 1,
           "command": [os.path.relpath(sys.argv[0], os.path.dirname(HERE)), *sys.argv[1:]] if argv is None
           else ["benchmarks/bench_text_stream.py", *argv],
           "machine": machine(), "config": config, "wall_s": time.time() - started, "tokens": len(deltas),
           "deltas": deltas, **result}
    report = table(doc)
    print(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, ensure_ascii=False)
            f.write("\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0 if doc["sanity"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
