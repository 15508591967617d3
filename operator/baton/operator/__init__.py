"""The Baton operator: reconciles PDDeployments into worker pods, services and a router."""
