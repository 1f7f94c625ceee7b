"""Every built-in part with settings of its own, imported so that each registry adds its parts' config sections to
the run config (mpp.config.SECTION_SOURCES). The library's own (the objectives and their targets, the evaluations'
settings) register when `mpp` is imported; what the pipelines add is imported here: the evaluators' registry, which
pairs each evaluation with its builder and registers the section of any evaluator added there. The registries load
no torch; the parts they name are imported when a run builds them.

Whatever reads or shows a run config imports this first: the command line (--help lists every key), the stages
through it, and the tests (conftest). A registry of new parts is one more import here.
"""

from .evaluations import registry  # noqa: F401  (the evaluators and the sections of any added there)
