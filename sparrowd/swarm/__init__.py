"""Pure state machines of the swarm (lease table; picker and choker to come).

Nothing in this package sleeps, awaits or touches a socket: every decision
takes ``now`` and returns what to do. The asyncio drivers live in
``sparrowd.daemon``.
"""
