"""The wire schema: request and reply bodies, their shared rules and the binary group record.

The clients import these modules and nothing else of `api`, so they import only pydantic, numpy and
msgpack: never FastAPI, the store or the service (tests/test_public_api.py).
"""
