"""Ingest: a submission parsed (JSON or binary), validated, checked against the store and queued,
held in the side buffer, or dropped.
"""
