"""systemd's notify protocol (``sd_notify``): READY/STOPPING/STATUS and the watchdog.

The watchdog ping must come from the event loop itself (:func:`run_notifier`), not a thread:
what it proves is that the loop still turns.

A datagram to the unix socket named by ``NOTIFY_SOCKET`` (``@name``: abstract namespace); nothing
when it is unset, so running outside systemd costs nothing.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Mapping

import trio

log = logging.getLogger(__name__)


def notify(message: str, env: Mapping[str, str] | None = None) -> bool:
    """Send one notification (``"READY=1"``, ``"STATUS=..."``); False when not under systemd."""
    address = (os.environ if env is None else env).get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(message.encode())
        except OSError as exc:
            log.warning("systemd notify failed: %s", exc)
            return False
    return True


def watchdog_interval(env: Mapping[str, str], pid: int) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings: half of ``WATCHDOG_USEC`` (sd_watchdog_enabled's
    rule), or None when systemd asked for none or asked another process (``WATCHDOG_PID``)."""
    usec = env.get("WATCHDOG_USEC", "")
    owner = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if owner and (not owner.isdigit() or int(owner) != pid):
        return None
    return int(usec) / 2e6


def status_line(loaded: int, loading: int, queued: int, inflight: int, draining: bool = False) -> str:
    """What ``systemctl status`` shows under the unit (``STATUS=``)."""
    state = "draining" if draining else "serving"
    return (
        f"{state}: {loaded} model{'s' * (loaded != 1)} loaded, {loading} loading, "
        f"{queued} queued, {inflight} request{'s' * (inflight != 1)} in flight"
    )


STATUS_INTERVAL = 5.0  # seconds between STATUS= updates when no watchdog asks for more often


async def run_notifier(status: Callable[[], str], env: Mapping[str, str] | None = None) -> None:
    """Ping the watchdog and report status from the event loop until cancelled.

    The pings come from a task of the Trio loop on purpose: a wedged loop (a blocking call, a
    busy handler) stops them, and systemd restarts the service after ``WatchdogSec``. ``STATUS=``
    goes out when it changed. Returns at once when not run by systemd (no ``NOTIFY_SOCKET``).
    """
    env = os.environ if env is None else env
    if not env.get("NOTIFY_SOCKET"):
        return
    interval = watchdog_interval(env, os.getpid())
    period = min(interval, STATUS_INTERVAL) if interval is not None else STATUS_INTERVAL
    if interval is not None:
        log.info("systemd watchdog: pinging every %.2fs", interval)
    last = ""
    while True:
        lines = ["WATCHDOG=1"] if interval is not None else []
        text = status()
        if text != last:
            lines.append(f"STATUS={text}")
            last = text
        if lines:
            notify("\n".join(lines), env)
        await trio.sleep(period)
