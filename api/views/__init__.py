"""What operators read: /status, the counters and the buffer's snapshot, /metrics, the dashboard's
data and the W&B run.
"""
