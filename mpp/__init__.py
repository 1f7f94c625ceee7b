"""Masked patch prediction pretraining of Vision Transformers: the library.

Importing it registers the settings of the library's own parts (the objectives and their targets, the evaluations),
so that `mpp.config.load_config` reads every shipped config without the command line's `pipelines`. The registries
load no torch.
"""

from mpp.model import registry as _objectives  # noqa: F401  (objective=, the mpp section, the targets' settings)
from mpp.evaluation import settings as _evaluations  # noqa: F401  (eval, fewshot, knn, probe, inspect)
