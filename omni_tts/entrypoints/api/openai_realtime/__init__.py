"""The OpenAI Realtime API (GA), the subset that reads text aloud: WS /v1/realtime (README.md)."""
from .connection import REALTIME_ROUTES

__all__ = ["REALTIME_ROUTES"]
