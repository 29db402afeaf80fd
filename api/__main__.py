"""`python -m api serve ...` is the same as `rollbuf serve ...`."""

from api.cli import main

main()
