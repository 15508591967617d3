"""The Kubernetes form on one machine: an API server, a node agent, Prometheus, the operator."""
