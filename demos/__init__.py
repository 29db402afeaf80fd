"""Demos of rollbuf run as its users run it: clients of the service (started in-process), never part of it.

`rollbuf demo` plays three environments with a scripted policy (`demos.mixing`); `rollbuf demo --learn`
trains a small torch policy through the service (`demos.learn`). docs/bring-your-environment.md's four-process
layout runs from here too: `rollbuf standin-inference` (a stand-in for vLLM, `demos.standin_inference`),
`rollbuf example-trainer` (`demos.example_trainer`) and `rollbuf example-producer` (`demos.example_producer`).
The service (`api/`) imports neither client; this package imports both, and is where these `rollbuf` commands
live (`demos.cli`).
"""
