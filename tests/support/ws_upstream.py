"""A WebSocket Responses endpoint and client (wsproto, blocking sockets) for capture tests.

Why: Codex can send its model calls over a WebSocket (its Responses WebSocket transport), which
the capture does not record; the tests check that such a session is *seen* (a row, a log line)
and that a refused handshake - what vLLM answers - loses nothing. The server answers each client
message with one ``response.completed`` event; ``accept=False`` answers the handshake 404.
"""

from __future__ import annotations

import json
import socket
import threading

from wsproto import ConnectionType, WSConnection
from wsproto.events import (AcceptConnection, CloseConnection, Message, RejectConnection, RejectData, Request,
                            TextMessage)


class WsUpstream:
    """Serves on 127.0.0.1 from a thread; one connection at a time is enough for the tests."""

    def __init__(self, accept: bool = True) -> None:
        self.accept = accept
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received: list[str] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> "WsUpstream":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        with conn:
            while True:
                data = conn.recv(65536)
                if not data:
                    return
                ws.receive_data(data)
                for event in ws.events():
                    if isinstance(event, Request):
                        if not self.accept:
                            body = b'{"detail":"Not Found"}'
                            conn.sendall(ws.send(RejectConnection(
                                status_code=404, has_body=True,
                                headers=[(b"content-type", b"application/json"),
                                         (b"content-length", str(len(body)).encode())])))
                            conn.sendall(ws.send(RejectData(data=body)))
                            return
                        conn.sendall(ws.send(AcceptConnection()))
                    elif isinstance(event, TextMessage):
                        self.received.append(event.data)
                        done = {"type": "response.completed",
                                "response": {"id": f"resp_{len(self.received)}", "status": "completed",
                                             "output": [], "usage": {"input_tokens": 1, "output_tokens": 1}}}
                        conn.sendall(ws.send(Message(data=json.dumps(done))))
                    elif isinstance(event, CloseConnection):
                        conn.sendall(ws.send(event.response()))
                        return


class WsClient:
    """A WebSocket client through an HTTP proxy (absolute-form target, credentials in
    ``Proxy-Authorization`` as harnesses send them)."""

    def __init__(self, proxy_port: int, upstream_port: int, proxy_auth: bytes, path: str = "/v1/responses") -> None:
        self.sock = socket.create_connection(("127.0.0.1", proxy_port), timeout=30)
        self.ws = WSConnection(ConnectionType.CLIENT)
        host = f"127.0.0.1:{upstream_port}"
        self.sock.sendall(self.ws.send(Request(host=host, target=f"http://{host}{path}",
                                               extra_headers=[(b"proxy-authorization", proxy_auth)])))
        self.status: int | None = None
        self.rejected = False
        while self.status is None:
            for event in self._events():
                if isinstance(event, AcceptConnection):
                    self.status = 101
                elif isinstance(event, RejectConnection):
                    self.status, self.rejected = event.status_code, True

    def _events(self) -> list:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the proxy closed the connection")
        self.ws.receive_data(data)
        return list(self.ws.events())

    def call(self, request: dict) -> dict:
        """Send one ``response.create`` and return the event that answers it."""
        self.sock.sendall(self.ws.send(Message(data=json.dumps({"type": "response.create", **request}))))
        while True:
            for event in self._events():
                if isinstance(event, TextMessage):
                    return json.loads(event.data)

    def close(self) -> None:
        try:
            self.sock.sendall(self.ws.send(CloseConnection(code=1000)))
            while not any(isinstance(e, CloseConnection) for e in self._events()):
                pass
        finally:
            self.sock.close()
