"""Batches: planned (pure), formed in one store transaction, served, kept for serving again,
acknowledged, and split among data-parallel ranks.
"""
