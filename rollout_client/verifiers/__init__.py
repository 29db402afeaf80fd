"""verifiers v1 environments as rollbuf producers (`pip install rollbuf[verifiers]`,
docs/bring-your-environment.md).

`environment` is the `Environment` whose rollout is one verifiers episode, `mapping` turns an episode into
rollbuf sequences (pure), `pool` runs verifiers' env-server pool in a watched child process, and `tasks`
leases a verifiers taskset from rollbuf. The names of `environment` are exported here too: `from
rollout_client.verifiers import VerifiersEnvironment` is the short path.
"""

from rollout_client.verifiers.environment import ExternalInference, LiveRollout, VerifiersEnvironment, verifiers_tasks

__all__ = ["ExternalInference", "LiveRollout", "VerifiersEnvironment", "verifiers_tasks"]
