"""Example environments served by gym-sessions."""
