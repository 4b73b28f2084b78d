"""What auditors use: verify the hash chains, replay, export."""
