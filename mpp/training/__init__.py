"""The loop and what it runs on: the step, meters, optimiser groups and schedule, the device runtime, checkpoints and resume, signals."""
