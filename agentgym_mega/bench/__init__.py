"""`agentgym-mega bench ...`: measurements that write JSON (speed lives here, never in tests)."""
