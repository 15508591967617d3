"""The controller-manager's part of the local cluster: deployments, endpoints, garbage."""
