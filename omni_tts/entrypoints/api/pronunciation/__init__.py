"""Pronunciation dictionaries: alias rules uploaded (ElevenLabs' routes) or given on the command line."""
