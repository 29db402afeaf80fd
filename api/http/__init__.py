"""The HTTP edge: the front door every request passes before a route, bodies and their budget, the
connection bounds, the OpenAPI description. It sits below every flow and imports none of them; the app that
wires it to the routes is `api.app` (`api/layers.py`).
"""
