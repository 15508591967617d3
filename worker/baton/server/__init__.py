"""The worker process: the engine behind an internal HTTP API, the decode side of the KV
handoff (reservations and a KV sink), the prefill side (layer streaming to a ticket),
migration of running sequences, drain and role switch, and Prometheus metrics.

Modules: `main` (CLI), `app` (routes), `worker` (wiring and lifecycle), `intake` (decode
side), `prefill` (prefill side), `migration` and `drain`, `streams` (per-request token
streams), `metrics`; pure helpers: `params`, `sse`, `roles`, `settings`, `errors`.
"""
