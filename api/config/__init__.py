"""The server's settings: declared once by concern (`groups`), gathered in one object (`settings`),
and docs/settings.md generated from them (`python -m api.config.doc`).
"""
