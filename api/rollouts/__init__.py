"""Groups whose rollouts arrive one by one: the open group's rules, the routes' transactions,
their metrics.
"""
