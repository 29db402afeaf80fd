"""The crash matrix (`make crash-matrix`, docs/crash-matrix.md): real processes (`rollbuf serve`, the stand-in
inference server, a trainer through `trainer_client`, producers through `rollout_client`) under one fault at a
time, on each durable store, with every side (whole groups, tasks leased from a dataset, per-rollout groups)
running at once; what happened to the data is counted from the clients' own records, not from the server's
word (`crash.records` is the format, `crash.count` the counter, `crash.run` one run, `crash.page` the page)."""
