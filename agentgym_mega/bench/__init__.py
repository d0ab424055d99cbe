"""`agentgym-mega bench ...`: benchmarks, each writing a JSON report (speed lives here, not in tests)."""
