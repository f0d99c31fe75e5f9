"""Stage 4: the ILP over strategies and reshards, its solvers, recompute and overlap terms."""
