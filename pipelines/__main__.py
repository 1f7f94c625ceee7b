"""`python -m mpp.pipelines STAGE ...`: the `mpp` command as a module, which is what `accelerate launch -m
mpp.pipelines STAGE ...` runs in every process of an installed mpp (in a checkout: `python -m pipelines`, or
launch.py)."""

import sys

from .cli import main

sys.exit(main())
