"""`agentgym-mega bench <name>`: benchmarks that write their figures as JSON."""
