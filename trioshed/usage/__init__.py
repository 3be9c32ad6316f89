"""Usage per API key and model, and token budgets: the pure :mod:`~trioshed.usage.ledger` (may
this key start, what did it spend), the SQLite :mod:`~trioshed.usage.db`, and the
:mod:`~trioshed.usage.recorder` that ``serve()`` runs to batch rows into it off the event loop."""
