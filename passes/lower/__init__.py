"""Stage 6: a plan lowered to each rank's program: reshard steps, recompute, schedule, emit, the lockstep simulator."""
