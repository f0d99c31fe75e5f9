"""Stage 3: the candidate layouts (strategies) of every node, rules found by experiment, and repeated blocks."""
