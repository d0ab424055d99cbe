"""`agentgym-mega scaling`: scaling experiments and their estimate at cluster scale.

* :mod:`.sweep`: the points of a sweep and a short training run per point, here (on a fresh
  simulated Ray cluster of the point's node count, or on the current cluster) or one Slurm job each.
* :mod:`.report`: each point's throughput and seconds per phase from its metrics, efficiency
  against the first point, a table and a plot.
* :mod:`.projection`: an estimate, not a measurement, for 7B-70B recipes at 1-16 nodes from the
  planner's memory and FLOP counts and stated hardware rates.
"""
