"""slime integration: weenv sandboxes for agentic RL rollouts."""
