"""rollbuf's service: an experience buffer between RL rollout handlers and trainers.

Importing `api.wire.schema` must stay cheap for the clients: nothing here imports FastAPI.
"""
