"""Fleet simulator and capacity planner for disaggregated prefill/decode serving.

`hardware` and `perf` model one worker, `workload` the traffic of a day, `fleet` the pools
and their queues, `strategies` the controller and its baselines, `simulate` and `plan` the
commands. The controller here is the same `baton.autoscaler.policy` a live loop runs.
"""
