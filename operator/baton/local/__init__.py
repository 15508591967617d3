"""The embedded runtime: the whole stack (workers, router) on one machine over Ray."""
