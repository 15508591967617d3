"""The node agent: the kubelet's part of the local cluster (pods as local processes)."""
