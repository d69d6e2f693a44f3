"""Coordination between ranks and with the launcher: the store-based context (dist), the
heartbeat watchdog, preemption, the event log, and the restart-safe rendezvous."""
