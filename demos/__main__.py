"""`python -m demos ...` is the same as `rollbuf ...`."""

from demos.cli import main

main()
