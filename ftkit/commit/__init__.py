"""The commit of a step to a tier: who writes which part, who writes the index, and the
messages between them (plan.py), run by one executor per kind of tier (shared.py for a
shared tier, ram.py for the node-RAM tier with its peer replicas)."""
