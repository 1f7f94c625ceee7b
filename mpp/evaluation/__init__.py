"""Scores of a backbone: few-shot ridge, kNN, the linear probe, the pretext validation, the inspection views, the statistics of a comparison."""
