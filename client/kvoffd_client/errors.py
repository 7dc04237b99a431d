"""What a failed request raises: the daemon's ERROR reply as an exception, or the daemon's absence.

Its own module so that code handling them (the vLLM connector, kvoffctl) needs nothing else.
"""

from __future__ import annotations

from kvoffd_client import protocol as P

#: the code of the replies a client makes up for requests a lost daemon took (never sent by a daemon)
UNAVAILABLE = "unavailable"


class KvoffdError(Exception):
    """An ERROR reply: ``code`` is a protocol.ErrorCode value (or ``unavailable``)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class DaemonUnavailable(KvoffdError):
    """No daemon answered (not reachable, refused, or lost while the request was out)."""

    def __init__(self, message: str = "the kvoffd daemon is not reachable"):
        super().__init__(UNAVAILABLE, message)


def answer(reply: P.Message) -> P.Message:
    """A request's reply, or the exception an ERROR reply stands for."""
    if isinstance(reply, P.Error):
        if reply.code == UNAVAILABLE:
            raise DaemonUnavailable(reply.message)
        raise KvoffdError(reply.code, reply.message)
    return reply
