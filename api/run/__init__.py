"""What every flow reads and writes inside its store transaction: the run state, the batches a run keeps
for serving again, the filters that drop a group, the rules free-form values are held to, the counters kept in
the store, and the work taken off the event loop. It sits below every flow and imports none of them
(`api/layers.py`).
"""
