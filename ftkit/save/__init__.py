"""Taking a snapshot: capture the state (capture, sharding), stage it in reused memory
(staging), write and commit it to a tier (persist)."""
