"""API keys: who may do what (`access`) and where the keys come from (`keyring`). Below the settings, which
read them, and the HTTP edge, which checks them (`api/layers.py`).
"""
