"""Where snapshots live: byte movement to any fsspec URL (storage), the node's RAM tier
(ram) and its peer replicas (peers), retention and deleting or retiring steps
(retention, lifecycle), and URL redaction (redact)."""
