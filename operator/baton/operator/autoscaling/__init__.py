"""The controller on Kubernetes: the autoscaler's loop run as a kopf daemon per PDDeployment
(`daemon`), acting through the PDDeployment and its pods (`actuator`).

The sizing, policy and loop themselves live in `baton.autoscaler`, which knows nothing of
kopf or Kubernetes; this package is where the two meet.
"""
