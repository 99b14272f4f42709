"""The asyncio side: the daemon, the tracker service, membership, metrics.

Thin drivers around the pure state machines of ``sparrowd.swarm``.
"""
