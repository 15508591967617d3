"""Baton's OpenAI-compatible router: tokenizes, picks workers, streams tokens back.

Pure routing policy lives in `policy.py` and `threshold.py`; HTTP at the edges (`app.py`,
`worker_client.py`, `discovery.py`).
"""
