"""The HTTP layer: the app, the front door every request passes before a route, bodies and their
budget, keys and roles, the connection bounds, the OpenAPI description.
"""
