"""The server's own modules: keys, settings, systemd, reload, drain of a real process."""
