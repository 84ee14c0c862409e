"""A worker's sockets: register with the pool, then answer commands until told to stop.

The worker's DEALER connects to the pool's ROUTER (registration, commands,
heartbeats); its PUSH connects to the pool's results PULL. One command in,
one reply out, in order, for each env. The loop only moves frames: what a
command does to an env is :mod:`workers.hosting`'s business.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import traceback
from typing import Any

import zmq

from workers.hosting import EnvHost
from zmqpool.errors import EnvMakerError, ProtocolError, RegistrationError
from zmqpool.specs import spec_to_data
from zmqpool.wire import (
    Command,
    Decoder,
    Encoder,
    Header,
    encode_message,
)

log = logging.getLogger("workers")


class Worker:
    """One worker process's connection to its pool.

    Args:
        router: the pool's ROUTER endpoint.
        identity: this worker's routing identity (stable across restarts).
        host: the envs, keyed by the indices this worker asks for.
        heartbeat_interval_s: how often to tell the pool we are alive.
    """

    def __init__(
        self,
        router: str,
        identity: bytes,
        host: EnvHost,
        heartbeat_interval_s: float = 1.0,
        register_timeout_s: float = 60.0,
        remote_slots: bool = False,
    ) -> None:
        self.router = router
        self.identity = identity
        self.host = host
        self.heartbeat_interval_s = heartbeat_interval_s
        self.register_timeout_s = register_timeout_s
        self.remote_slots = remote_slots
        self.context = zmq.Context()
        self.dealer = self._socket(zmq.DEALER, identity)
        self.dealer.connect(router)
        self.push: zmq.Socket | None = None
        self.token = b""
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.dropped = 0
        self._stop = threading.Event()

    def _socket(self, kind: int, identity: bytes | None = None) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.linger = 0
        if identity is not None:
            sock.identity = identity
        return sock

    # ------------------------------------------------------------ registration

    def register(self) -> None:
        """Announce our envs and specs; wait for the pool's WELCOME."""
        reg = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "envs": sorted(self.host.envs),
            "remote": self.remote_slots,
            "specs": [spec_to_data(self.host.envs[i].specs) for i in sorted(self.host.envs)],
        }
        self.dealer.send(Header(Command.REGISTER, body={"reg": reg}).encode())
        header = self._await_registration_reply()
        if header.command == Command.REFUSE:
            reason = (header.body or {}).get("err", "no reason given")
            raise RegistrationError(f"the pool refused this worker: {reason}")
        self._accept_welcome((header.body or {}).get("reg"))

    def _await_registration_reply(self) -> Header:
        deadline = time.monotonic() + self.register_timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            if not self.dealer.poll(int(remaining * 1000)):
                break
            frames = self.dealer.recv_multipart()
            try:
                header = Header.decode(frames[0])
            except ProtocolError as err:
                log.warning("dropped a malformed message while registering: %s", err)
                continue
            if header.command in (Command.WELCOME, Command.REFUSE):
                return header
        raise RegistrationError(
            f"no answer from the pool at {self.router} within {self.register_timeout_s} s"
        )

    def _accept_welcome(self, reg: Any) -> None:
        if not isinstance(reg, dict) or not isinstance(reg.get("token"), bytes):
            raise ProtocolError("WELCOME without a token")
        envs, results = reg.get("envs"), reg.get("results")
        if not isinstance(envs, list) or len(envs) != len(self.host.envs):
            raise ProtocolError("WELCOME assigns a different number of envs than we host")
        if not isinstance(results, str):
            raise ProtocolError("WELCOME without a results endpoint")
        # The pool may place our envs at other indices (remote workers ask for slots).
        hosted = [self.host.envs[i] for i in sorted(self.host.envs)]
        self.host.envs = dict(zip(envs, hosted, strict=True))
        self.token = reg["token"]
        self.push = self._socket(zmq.PUSH)
        self.push.connect(results)
        log.info("registered envs %s with the pool at %s", envs, self.router)

    # ------------------------------------------------------------ serving

    def serve(self) -> None:
        """Answer commands until CLOSE (or the process is killed)."""
        heartbeat = threading.Thread(target=self._heartbeat_loop, daemon=True)
        heartbeat.start()
        try:
            while not self._stop.is_set():
                if not self.dealer.poll(int(self.heartbeat_interval_s * 1000)):
                    continue
                frames = self.dealer.recv_multipart(copy=True)
                if not self._handle(frames):
                    break
        finally:
            self._stop.set()

    def _handle(self, frames: list[bytes]) -> bool:
        """Handle one message; False when told to close."""
        try:
            header = Header.decode(frames[0])
        except ProtocolError as err:
            self.dropped += 1
            log.warning("dropped a malformed command: %s", err)
            return True
        if header.command == Command.CLOSE:
            return False
        if header.command != Command.PING:
            self._execute(header, frames[1:])
        return True

    def _execute(self, header: Header, frames: list[bytes]) -> None:
        try:
            # bytearray: env code may write into its input; zmq's buffers are read-only.
            parts = self.decoder.decode(header, [bytearray(f) for f in frames])
            td = parts[0].to_tensordict() if parts else None
            out = self.host.run(header.command, header.env, td, header.body)
            reply = encode_message(
                Header(Command.RESULT, header.env, header.seq, self.token),
                [self.encoder.encode(part) for part in out],
            )
        except Exception as err:
            reply = self._error_reply(header, err)
        assert self.push is not None
        self.push.send_multipart(reply, copy=False)

    def _error_reply(self, header: Header, err: Exception) -> list[Any]:
        malformed = isinstance(err, ProtocolError)
        what = "malformed command" if malformed else "env raised"
        log.warning("env %d: %s: %r", header.env, what, err)
        body = {
            "err": f"{what}: {err!r}",
            "tb": traceback.format_exc(),
            "kind": "protocol" if malformed else "env",  # "env" may restart the worker
        }
        return [Header(Command.ERROR, header.env, header.seq, self.token, body=body).encode()]

    def _heartbeat_loop(self) -> None:
        # Its own socket: zmq sockets are not thread-safe, and a long env step
        # in the main thread must not silence the heartbeats.
        sock = self._socket(zmq.DEALER, self.identity + b"!hb")
        sock.connect(self.router)
        beat = Header(Command.HEARTBEAT).encode()
        try:
            while not self._stop.wait(self.heartbeat_interval_s):
                sock.send(beat, zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        finally:
            sock.close()

    def report_maker_failure(self, err: EnvMakerError) -> None:
        body = {"err": str(err).split("\n", 1)[0], "tb": err.remote_traceback}
        self.dealer.send(Header(Command.FAILED, err.env_index, body=body).encode())
        # Give the message a moment to leave before the process exits (linger is 0).
        time.sleep(0.2)

    def close(self) -> None:
        self._stop.set()
        self.host.close()
        self.context.destroy(linger=0)
