"""Alibaba DashScope's Qwen-TTS APIs over our front end: the Realtime WebSocket and the plain HTTP call (README.md)."""
