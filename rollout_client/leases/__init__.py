"""What a producer leases from rollbuf, and what it leases from: tasks (`tasks.LeasedTasks`, docs/tasks.md), so
that many producers share one dataset, registered from the producer's side by `datasets.register_dataset`; and
the slots of per-rollout groups (`open_groups.OpenGroups`, docs/rollouts.md), so that one group's rollouts can
come from many producers and a producer that stops loses none of them.
"""
