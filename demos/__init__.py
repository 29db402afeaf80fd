"""Demos of rollbuf run as its users run it: clients of the service (started in-process), never part of it.

`rollbuf demo` plays three environments with a scripted policy (`demos.mixing`); `rollbuf demo --learn`
trains a small torch policy through the service (`demos.learn`). The service (`api/`) imports neither
client; this package imports both, and is where the `rollbuf` console command lives (`demos.cli`).
"""
