"""Calibrated methods: quantizations that run the model on calibration text (docs/development.md,
"A calibrated run"). A method is a policy object saying what it collects in which pass of the
block-by-block run (engine/calibrate/sequential.py) and what it makes of it; its numerics are
pure functions in numerics/ (GPTQ: numerics/gptq.py). What a method chooses waits in the run's
Spill (engine/spill.py) and the usual quantize loop writes it."""
