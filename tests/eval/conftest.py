"""Simulator/eval tests: see oracle/sim_stack.py for when they run."""

from oracle.sim_stack import require_sim_stack

require_sim_stack()
