"""The store: engines kept by key on this machine (local), the remote tier and the fleet over it, the
device fingerprint and the tactic caches that enter or outlive a key, and the housekeeping (stats, prune)."""
