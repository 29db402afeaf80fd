"""Tasks leased from a registered dataset: the order, the cursor, leases and fates, and their metrics."""
