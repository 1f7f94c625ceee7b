"""Every built-in part with settings of its own, imported so that each registry adds its parts' config sections to
the run config (mpp.config.SECTION_SOURCES): the objectives and their targets, the evaluators. The registries load
no torch; the parts they name are imported when a run builds them.

Whatever reads or shows a run config imports this first: the command line (--help lists every key), the stages
through it, and the tests (conftest). A registry of new parts is one more import here.
"""

import mpp.model.registry  # noqa: F401  (objective=, the mpp section and the targets' settings)
from .evaluations import registry  # noqa: F401  (the evaluators' sections: fewshot, knn, probe, eval, inspect)
