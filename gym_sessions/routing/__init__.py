"""Session routing across workers: id sources, claims, the router, the hop, private sockets."""
