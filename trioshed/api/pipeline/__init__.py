"""The way a request travels: the listener, the fast path, the one request wrapper and its gate,
the preamble every route starts with, the hop to a runner (upstream), the fleet's forwarding, and
the drain."""
