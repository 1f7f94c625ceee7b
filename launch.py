"""mpp's command line as a script, for `accelerate launch launch.py STAGE ...`; the installed `mpp` command is the same."""

import sys

from pipelines.cli import main

if __name__ == "__main__":
    sys.exit(main())
