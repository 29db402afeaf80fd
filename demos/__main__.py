"""`python -m demos [--learn] ...` is the same as `rollbuf demo [--learn] ...`."""

import sys

from demos.cli import demo

demo(sys.argv[1:])
