"""Pure manifest builders: validated spec in, Kubernetes objects out. No I/O here."""
