"""polar-train: RL training for coding agents without changing the agent."""
__version__ = "0.1.0"
