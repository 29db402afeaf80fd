"""What operators read: /status, /metrics, the dashboard's data and the W&B run, from the counters and the
buffer's snapshot (`api.run.stats`) and this process's meters (`api.meters`).
"""
