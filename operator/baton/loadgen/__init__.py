"""`baton bench`: an async load generator for OpenAI-compatible streaming endpoints."""
