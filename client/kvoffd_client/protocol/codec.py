"""Encoding and decoding frames: ``decode`` validates one frame in one C call and raises only
``ProtocolError`` (with the code the complaint deserves, and the seq and job id it echoes)."""

from __future__ import annotations

import re
from typing import Any, Union

import msgspec

from kvoffd_client.protocol.codes import ErrorCode, ProtocolError
from kvoffd_client.protocol.limits import KEY_SIZE, MAX_FRAME_BYTES, MEMORY_KINDS
from kvoffd_client.protocol.messages import MESSAGES, REQUESTS, Error, Message

_DECODERS = {
    only_requests: msgspec.msgpack.Decoder(Union[tuple(c for c in MESSAGES.values()  # noqa: UP007
                                                       if not only_requests or c.op in REQUESTS)])
    for only_requests in (False, True)
}
_encode = msgspec.msgpack.Encoder().encode


class _Envelope(msgspec.Struct):
    """What an ERROR reply echoes from a refused frame, read only when the frame is refused."""

    seq: Any = 0
    job_id: Any = None


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_HINTS = {"keys": f"must be one binary of {KEY_SIZE}-byte keys back to back",
          "block_ids": "must be one binary of little-endian int32"}
_FIELD = re.compile(r"`\$\.([A-Za-z_]\w*)")
_TOO_DEEP = "msgpack nested too deeply (no message of this protocol nests more than a few levels)"


def encode(msg: Message) -> bytes:
    return _encode(msg)


def decode(frame: bytes, *, requests_only: bool = False) -> Message:
    """Parse and validate one frame. Raises ProtocolError with the right code; never anything else."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE, f"frame of {len(frame)} bytes; at most {MAX_FRAME_BYTES}")
    try:
        return _DECODERS[requests_only].decode(frame)
    except msgspec.ValidationError as e:  # (a DecodeError: first)
        err = _refusal(str(e))
    except msgspec.DecodeError as e:
        err = ProtocolError(ErrorCode.BAD_FRAME, f"not a msgpack message: {e}")
    except ProtocolError as e:  # raised by a __post_init__ check
        err = e
    except RecursionError:  # msgspec's answer to maps nested thousands deep: no message is that deep
        err = ProtocolError(ErrorCode.BAD_FRAME, _TOO_DEEP)
    if err.code is not ErrorCode.BAD_FRAME:
        try:
            err.seq, err.job_id = _echo(frame)
        except RecursionError:  # e.g. a seq nested 100k deep: refused above for its type, at the first level
            err = ProtocolError(ErrorCode.BAD_FRAME, _TOO_DEEP)
    raise err


def _refusal(text: str) -> ProtocolError:
    """An ERROR for msgspec's complaint, e.g. "Expected `int` >= 0 - at `$.seq`": the field names the code."""
    reason, _, where = text.partition(" - at ")
    m = _FIELD.search(where)
    if m is None:  # about the whole message
        if "`op`" in reason:  # "Object missing required field `op`"
            return ProtocolError(ErrorCode.UNKNOWN_OP, "a message needs an op")
        if reason.startswith("Object missing required field"):
            return ProtocolError(ErrorCode.BAD_FIELD, reason)
        return ProtocolError(ErrorCode.BAD_FRAME, f"a message must be a msgpack map ({reason})")
    if where == "`$.memory.kind`":  # a kind this protocol does not know (e.g. the old path kind)
        return ProtocolError(ErrorCode.MEMORY_UNREACHABLE, f"memory.kind: {reason}; this protocol knows "
                             f"{list(MEMORY_KINDS)} (a daemon says which it serves in hello_ok)")
    name = m.group(1)
    if name == "op":
        return ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op ({reason})")
    if name in _HINTS:
        return ProtocolError(ErrorCode.BAD_KEY if name == "keys" else ErrorCode.BAD_FIELD,
                             f"{name} {_HINTS[name]} ({reason})")
    inside = "" if where == f"`$.{name}`" else f" (at {where})"  # e.g. "`key` in `$.memory`"
    return ProtocolError(ErrorCode.BAD_FIELD, f"{name}: {reason}{inside}")


def _echo(frame: bytes) -> tuple[int, int | None]:
    """The seq (and job id) a refused frame carried, where they are well-formed."""
    try:
        env = _ENVELOPE.decode(frame)
    except msgspec.DecodeError:
        return 0, None
    seq = env.seq if type(env.seq) is int and 0 <= env.seq < (1 << 63) else 0
    return seq, env.job_id if type(env.job_id) is int else None


def error_for(exc: ProtocolError) -> Error:
    return Error(seq=exc.seq, code=exc.code.value, message=exc.message, job_id=exc.job_id)

