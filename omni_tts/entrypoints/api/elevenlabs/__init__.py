"""ElevenLabs' REST API over the one front end (README.md here)."""
from .text_to_speech import TEXT_TO_SPEECH_ROUTES
from .voices import VOICE_ROUTES

ELEVENLABS_ROUTES = [*TEXT_TO_SPEECH_ROUTES, *VOICE_ROUTES]
