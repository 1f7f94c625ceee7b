"""What every stage runs on: the command line's record, starting a run, the run directory's policy, the training sequence, its data, tracking."""
