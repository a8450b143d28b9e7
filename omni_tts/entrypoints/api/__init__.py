"""The HTTP and WebSocket API: one aiohttp app (app.py) over a TTS client (orchestrator/tts_client.TTSClient),
one module per route family and one per concern the routes share (server_config, state, admission, errors,
auth, access_log); the HTTP contract (schema, openapi, names, metrics) beside them. README.md lists them."""
