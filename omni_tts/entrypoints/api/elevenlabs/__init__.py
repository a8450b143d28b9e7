"""ElevenLabs' REST API over the one front end (README.md here). The WebSockets' routes are
`stream_input.WEBSOCKET_ROUTES`, which app.py adds itself: they import auth, which imports openapi, which imports this
package."""
from .text_to_speech import TEXT_TO_SPEECH_ROUTES
from .voices import VOICE_ROUTES

ELEVENLABS_ROUTES = [*TEXT_TO_SPEECH_ROUTES, *VOICE_ROUTES]
