"""weenv: lazily provisioned, isolated environments for agentic RL and agent evaluation."""

__version__ = "0.1.0"
