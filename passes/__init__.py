"""The compiler's passes, a folder per stage in the order data flows (each imports its own
stage and earlier ones only; tests/test_layers.py checks it):

    trace -> rules -> strategies -> solve -> plan -> lower
"""
