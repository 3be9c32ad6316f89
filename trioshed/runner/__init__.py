"""llama-server children: the command line (pure), the supervised process, its upstream HTTP."""
