"""Stage 5: complete plans: plain, pipelined (every stage's plan inside), dynamic, hand-pinned; planner.py is the entry."""
