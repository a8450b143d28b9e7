"""The HTTP and WebSocket API: one aiohttp app (app.py) over an engine (orchestrator/engine_protocol.TTSEngine),
one module per route family and one per concern the routes share (config, state, admission, errors, auth, access
log)."""
