"""Evaluators (scores during training, EVALUATORS) and the commands that score a saved backbone with them."""
