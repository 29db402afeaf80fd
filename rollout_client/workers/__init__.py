"""Worker processes: the runner's groups run on them when `num_workers > 0`, so that CPU-heavy rollouts never
stall the runner's event loop or each other.

`pool` starts, feeds and replaces the workers (its docstring lists the messages between the two sides),
`process` is what runs inside one, `ipc` the channel between them, and `recycling` when a worker is replaced
by a fresh one.
"""
