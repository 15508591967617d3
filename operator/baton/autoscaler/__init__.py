"""Pool sizing and role-conversion policy for a prefill/decode fleet.

`sizing` holds the closed-form capacity formulas, `step_model` the online fit of decode
step time, `inputs` the data exchanged with a control loop and `policy` the decision rule.
All of it is pure: no I/O, no clocks read, so simulators and live loops share it.
"""
