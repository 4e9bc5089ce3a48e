"""Peer-to-peer calls, shared by the client and the volunteer node: the hop a call goes to, the transports (direct
TCP or libp2p, unary or streamed, chosen in ``transport.py``), typed calls (``remote.py``) and the private event loop
that synchronous code drives them from."""
