"""PPO's operators on placed models, with the data movement between them (README.md)."""
