"""Limits on what one request may ask for, shared by the router's API and the engine."""

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
