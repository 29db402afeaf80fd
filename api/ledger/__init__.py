"""The ledger: what each group and step row says, the one recorder the transactions report to,
retention, the replies, and the drop-bias monitor fed from it.
"""
