"""A small Kubernetes API server: the object store, its HTTP face, and what kubectl needs."""
